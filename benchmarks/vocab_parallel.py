"""The vocab-parallel path on an NCCL group beside the single-process op: fwd+bwd time, peak memory, agreement.

    python -m benchmarks.vocab_parallel                 # world size 1: the distributed path doing nothing
    python -m benchmarks.vocab_parallel --world 2       # two GPUs, each rank holding half the vocabulary
    python -m benchmarks.vocab_parallel --device cpu --n 16 --hidden 32 --vocab 101 --backends reference  # gloo

World size 1: one rank holds the whole vocabulary, so the time over the plain op is the path's overhead (the
vocabulary-size exchange and its host read, one statistics all-gather per chunk, the stand-in's extra kernel pass
and the dX all-reduce, on a group of one). World size 2: each rank's time for its half, beside the single-process
op on the whole vocabulary on that GPU. Both compare the loss and the gradients with the single-process op on the
same inputs (the weight's gradient on this rank's slice). Timing: liger_dispatch.timing.bench at world size 1 (run in
this process); with more ranks, which must make the same calls, the median wall time of a fixed count of synced
repetitions. On the CPU (gloo) only to check that the script runs.
Writes a markdown table (--out, default benchmarks/results/vocab_parallel_<gpu>.md) and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import clocks, env, workloads
from benchmarks.shapes import DTYPES, LM_OPS, Case
from liger_dispatch import dispatch, timing
from liger_dispatch.core.table import TABLE

# the arguments of each op that hold a slice of the vocabulary, and the dim it is split on
SLICED = {"flce": {1: 0}, "fused_linear_jsd": {1: 0, 3: 0}, "fused_linear_kl_div": {1: 0, 2: 1}}
LOCKSTEP_WARMUP, LOCKSTEP_REPS = 3, 15


def vocab_parallel_backends(op: str, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Backends that serve `op` here and implement the vocab-parallel kernel-level ops (reference last)."""
    with_vp = {i.backend for i in TABLE.candidates("ce_vp_stats")}
    return [b for b in dispatch.available_backends(op, device, dtype) if b in with_vp]


def _slices(inputs, op, rank, world):
    """The op's arguments as this rank holds them: the vocabulary-sliced ones cut into `world` even slices."""
    args = list(inputs.args)
    for index, dim in SLICED[op].items():
        whole = args[index].detach()
        size = -(-whole.shape[dim] // world)
        part = whole.narrow(dim, rank * size, min(size, whole.shape[dim] - rank * size)).clone()
        args[index] = part.requires_grad_(inputs.args[index].requires_grad)
    return args


def _rel(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _lockstep_ms(fn, grads, device) -> float:
    """Median wall ms of fn over a fixed count of synced repetitions (every rank runs the same count)."""
    times = []
    for rep in range(LOCKSTEP_WARMUP + LOCKSTEP_REPS):
        for t in grads:
            t.grad = None
        ms = timing.wall_ms(fn, device)
        if rep >= LOCKSTEP_WARMUP:
            times.append(ms)
    return statistics.median(times)


def measure(op, backend, case, group, device, rep_ms):
    """One row: the single-process op and the vocab-parallel one on the same inputs, timed and compared."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs = workloads.make_inputs(case, device, seed=0)
    handle = dispatch.op(op, backend=None if backend == "auto" else backend)
    mine = _slices(inputs, op, rank, world)
    mine[0] = inputs.args[0].detach().clone().requires_grad_()  # its own leaf: the gradients are compared
    mine_leaves = [mine[0], mine[1]]

    def single():
        timing.backward(handle(*inputs.args, **inputs.kwargs), inputs)

    def parallel():
        handle(*mine, process_group=group, **inputs.kwargs).backward()

    loss_single = handle(*inputs.args, **inputs.kwargs)
    loss_single.backward()
    loss_vp = handle(*mine, process_group=group, **inputs.kwargs)
    loss_vp.backward()
    size = mine[1].shape[0]
    errors = (_rel(loss_vp, loss_single), _rel(mine[0].grad, inputs.args[0].grad),
              _rel(mine[1].grad, inputs.args[1].grad.narrow(0, rank * size, size)))
    if world == 1:
        bench = lambda fn, leaves: timing.bench(fn, leaves, device, warmup_ms=rep_ms, rep_ms=rep_ms).ms  # noqa: E731
    else:
        bench = lambda fn, leaves: _lockstep_ms(fn, leaves, device)  # noqa: E731
    single_ms, parallel_ms = bench(single, inputs.leaves), bench(parallel, mine_leaves)
    peaks = clocks.peak_mb(single, inputs.leaves, device), clocks.peak_mb(parallel, mine_leaves, device)
    return dict(op=op, backend=backend, world=world, rank=rank, n=case.dim("N"), single_ms=single_ms,
                parallel_ms=parallel_ms, single_mb=peaks[0], parallel_mb=peaks[1], errors=errors)


def rows(rank, world, args, store_path) -> list[dict]:
    """Every row of this rank, on a process group of `world` ranks (NCCL on GPU `rank`, gloo on the CPU)."""
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    dtype = DTYPES[args.dtype]
    measured = []
    try:
        for op in args.ops:
            for backend in args.backends or ["auto", *vocab_parallel_backends(op, device, dtype)]:
                for n in args.n:
                    case = Case(op, "llama3", n, (("N", n), ("H", args.hidden), ("V", args.vocab)), dtype, "fwd+bwd")
                    measured.append(measure(op, backend, case, dist.group.WORLD, device, args.rep_ms))
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return measured


def _rank_rows(rank, world, args, store_path, queue):
    queue.put(rows(rank, world, args, store_path))


def table(rows, environment) -> str:
    lines = [f"# Vocab-parallel path on NCCL beside the single-process op ({environment.gpu})", "",
             f"{environment.date}, driver {environment.driver}, "
             + ", ".join(f"{k} {v}" for k, v in environment.versions.items()) + f". Command: `{environment.command}`",
             "", "bf16 unless said; fwd+bwd; each rank's time for its slice; errors are relative (Frobenius) against "
             "the single-process op on the same inputs; dW on this rank's slice.", "",
             "| op | backend | world | rank | N | single ms | vocab-parallel ms | overhead | peak MB single / vp "
             "| loss err | dX err | dW err |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['backend']} | {r['world']} | {r['rank']} | {r['n']} | {r['single_ms']:.3f} | "
                     f"{r['parallel_ms']:.3f} | {100 * (r['parallel_ms'] / r['single_ms'] - 1):+.1f}% | "
                     f"{r['single_mb'] or 0:.0f} / {r['parallel_mb'] or 0:.0f} | "
                     + " | ".join(f"{e:.1e}" for e in r["errors"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vocab_parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=1, help="ranks, one GPU each (default 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--ops", nargs="+", default=list(LM_OPS), choices=LM_OPS)
    parser.add_argument("--backends", nargs="+", help="default: auto and every backend with vocab-parallel kernels")
    parser.add_argument("--n", nargs="+", type=int, default=[4096])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--rep-ms", type=float, default=200.0)
    parser.add_argument("--out", help="markdown file (default benchmarks/results/vocab_parallel_<gpu>.md)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"--world {args.world} needs {args.world} GPUs, this machine has {torch.cuda.device_count()}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        if args.world == 1:
            measured = rows(0, 1, args, store)
        else:
            queue = mp.get_context("spawn").SimpleQueue()
            mp.start_processes(_rank_rows, args=(args.world, args, store, queue), nprocs=args.world,
                               start_method="spawn")
            measured = [r for _ in range(args.world) for r in queue.get()]
    measured.sort(key=lambda r: (r["op"], r["backend"], r["rank"]))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    environment = dataclasses.replace(env.collect(device, []),
                                      command=" ".join(["python -m benchmarks.vocab_parallel", *(argv or sys.argv[1:])]))
    text = table(measured, environment)
    out = args.out or os.path.join("benchmarks", "results", f"vocab_parallel_{environment.gpu_short}.md")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
