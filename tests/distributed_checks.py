"""Running cases on a real process group: one pair of worker processes per test module runs every case, each rank
records its verdicts, and the module's tests read them. A case is a function of (backend, group) that raises on a
mismatch; both ranks run every case in the same order, so a failed case does not stall the next one.

On the CPU the group is gloo over a FileStore; `nccl` on a host with as many GPUs as ranks, where each rank's
default device is its GPU (so the cases make their tensors there).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
import traceback
import zlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=90)


def spawn(cases: dict[str, Callable], world: int, workdir: str, backend: str = "gloo",
          blocked: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """Runs `cases` (name -> fn(group)) on `world` ranks; returns each rank's {name: "ok" or the traceback}.
    The `blocked` modules fail to import in the workers (a backend the cases do not use costs no import time)."""
    mp.spawn(_worker, args=(world, workdir, backend, cases, blocked), nprocs=world, join=True)
    results = []
    for rank in range(world):
        with open(os.path.join(workdir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def verdict(results: list[dict[str, str]], name: str) -> None:
    """Fails with every rank's traceback unless the case passed on every rank."""
    failed = {rank: r.get(name, "did not run") for rank, r in enumerate(results) if r.get(name) != "ok"}
    assert not failed, "\n".join(f"rank {rank}: {why}" for rank, why in failed.items())


def _worker(rank: int, world: int, workdir: str, backend: str, cases: dict[str, Callable], blocked) -> None:
    sys.modules.update(dict.fromkeys(blocked))  # None in sys.modules: `import name` raises ImportError
    if backend == "nccl":
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    store = dist.FileStore(os.path.join(workdir, "store"), world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    results = {}
    try:
        for name, case in cases.items():
            torch.manual_seed(zlib.crc32(name.encode()))  # the same inputs on every rank
            start = time.perf_counter()
            try:
                case(dist.group.WORLD)
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
            if os.environ.get("LIGER_TEST_TIMES"):
                print(f"rank {rank} {name}: {time.perf_counter() - start:.2f} s", flush=True)
    finally:
        with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def same_on_every_rank(name: str, t: torch.Tensor, group) -> None:
    """t is bit-for-bit the same tensor on every rank."""
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t.detach().contiguous(), group=group)
    for rank, other in enumerate(gathered):
        assert torch.equal(other, gathered[0]), f"{name} differs between rank 0 and rank {rank}"


def slice_of(t: torch.Tensor, dim: int, sizes: tuple[int, ...], rank: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of t along dim when the slices have these sizes, in rank order."""
    return t.narrow(dim, sum(sizes[:rank]), sizes[rank])


@contextlib.contextmanager
def group_of_one(backend: str):
    """A process group of this process alone (gloo, or nccl on GPU 0), torn down after."""
    device = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **device)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
