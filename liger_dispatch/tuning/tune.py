"""`python -m liger_dispatch tune`: time every backend that can serve each (op, dtype, shape) here and write
the table that auto selection reads (liger_dispatch/tuning/tuned.py).

    python -m liger_dispatch tune --out h200.json         # the default set: ~2-3 minutes on an H200
    LIGER_TUNED_TABLE=$PWD/h200.json python train.py       # use it (or copy it to liger_dispatch/tuning/tables/)

A point is one op at one shape; its bucket is the one tuned.bucket_of gives the call. Each backend is timed
fwd+bwd through `dispatch.op(op, backend=b)` (one whose capability or shape predicate turns the point down
is not timed): the median of the repetitions after warm-up, L2 flushed and gradients reset before each one,
CUDA events on a GPU, a host clock elsewhere. First its outputs are compared with the reference's where the
reference's logits fit (N * V <= CHECK_LOGITS); a backend that disagrees is reported and left out. The
reference is not timed: auto selection uses it only as the fallback. An existing table at --out made with
the same key keeps its other entries.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from liger_dispatch import dispatch, settings
from liger_dispatch.core import selection
from liger_dispatch.tuning import tuned
from liger_dispatch.capability import dtype_name
from liger_dispatch.errors import FallbackWarning
from liger_dispatch.core.table import REFERENCE

DEFAULT_OPS = ("flce", "fused_linear_jsd", "fused_linear_kl_div", "mhc_coeffs")
DEFAULT_NS = (1024, 2048, 4096, 8192, 16384)
DEFAULT_BETAS = (0.5, 0.0, 1.0)
DEFAULT_MHC = ((4, 512, 4, 1024), (4, 2048, 4, 4096))  # (B, T, HC, C)
CHECK_LOGITS = 2**29
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 2e-3}
L2_FLUSH_BYTES = 256 * 2**20


@dataclass
class Point:
    """One op at one shape: the call's arguments, the leaves whose gradients it makes, the upstream grads."""

    op: str
    shape: str
    args: tuple
    kwargs: dict
    leaves: list
    upstream: Optional[tuple] = None
    check: bool = True


# ---------------------------------------------------------------- inputs


def _randn(shape, dtype, device, std=1.0):
    return (torch.randn(shape, device=device) * std).to(dtype)


def _head(n, hidden, vocab, dtype, device):
    """x [N, H] ~ N(0, 1) and W [V, H] ~ N(0, 1/H): logits of unit scale, as a trained head gives."""
    return _randn((n, hidden), dtype, device).requires_grad_(), _randn((vocab, hidden), dtype, device,
                                                                      hidden ** -0.5).requires_grad_()


def _labels(n, vocab, device):
    labels = torch.randint(0, vocab, (n,), device=device)
    return labels.masked_fill_(torch.rand(n, device=device) < 0.05, -100)  # a few ignored rows, as in training


def lm_points(op, n, hidden, vocab, dtype, device, betas, target_dtypes):
    shape = f"N={n} H={hidden} V={vocab}"
    check = n * vocab <= CHECK_LOGITS
    x, w = _head(n, hidden, vocab, dtype, device)
    if op == "flce":
        yield Point(op, shape, (x, w, _labels(n, vocab, device)), {}, [x, w], check=check)
    elif op == "fused_linear_jsd":
        xt, wt = (t.detach() for t in _head(n, hidden, vocab, dtype, device))
        labels = _labels(n, vocab, device)
        for beta in betas:
            yield Point(op, shape, (x, w, xt, wt, labels), {"jsd_beta": beta}, [x, w], check=check)
    elif op == "fused_linear_kl_div":
        for target_dtype in target_dtypes:
            target = torch.empty(n, vocab, dtype=target_dtype, device=device)
            for start in range(0, n, 2048):  # bounds the fp32 temporary
                rows = target[start:start + 2048]
                rows.copy_(torch.softmax(torch.randn(rows.shape, device=device) * 2.0, dim=-1))
            yield Point(op, shape, (x, w, target, _labels(n, vocab, device)), {}, [x, w], check=check)
            target = None
    else:
        raise ValueError(f"tune: no LM-head inputs for op {op!r}")


def mhc_point(b, t, hc, c, dtype, device):
    k, m = hc * c, hc * hc + 2 * hc
    leaves = [_randn((b, t, hc, c), dtype, device), _randn((k, m), dtype, device, k ** -0.5),
              _randn((m,), torch.float32, device, 0.1), *(0.5 + torch.rand((), device=device) for _ in range(3))]
    for leaf in leaves:
        leaf.requires_grad_()
    upstream = (torch.randn(b, t, hc, device=device), torch.randn(b, t, hc, device=device),
                torch.randn(b, t, hc, hc, device=device))
    return Point("mhc_coeffs", f"B={b} T={t} HC={hc} C={c}", tuple(leaves), {}, leaves, upstream)


# ---------------------------------------------------------------- running and timing


def _outputs(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def step(fn: Callable, point: Point) -> tuple:
    """One forward and backward; the forward's outputs, detached."""
    for leaf in point.leaves:
        leaf.grad = None
    outs = _outputs(fn(*point.args, **point.kwargs))
    torch.autograd.backward(outs, point.upstream)
    return tuple(o.detach() for o in outs)


def rel_err(got: tuple, want: tuple) -> float:
    """The worst relative norm of the difference over the outputs; inf when not finite."""
    worst = 0.0
    for g, w in zip(got, want):
        diff = torch.linalg.vector_norm(g.float() - w.float()).item()
        worst = max(worst, diff / max(torch.linalg.vector_norm(w.float()).item(), 1e-30))
    return worst if math.isfinite(worst) else math.inf


class Timer:
    """Medians of repeated calls: CUDA events with L2 flushed before each repetition, or a host clock."""

    def __init__(self, device: torch.device, reps: int, warmup: int):
        self.device, self.reps, self.warmup = device, reps, warmup
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def median_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.flush is None:
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
                continue
            self.flush.zero_()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        times.sort()
        return times[len(times) // 2]


def backends_for(op: str, device: torch.device, dtype: torch.dtype) -> tuple[list[str], dict[str, str]]:
    """(the backends that can serve op here, {the others: why not}), the reference left out."""
    status = dispatch.backend_status(op, device, dtype)
    usable = [b for b in dispatch.available_backends(op, device=device, dtype=dtype) if b != REFERENCE]
    return usable, {b: why for b, why in status.items() if why is not None and b != REFERENCE}


def measure(point: Point, backends: list[str], timer: Timer, dtype: torch.dtype, log) -> dict[str, float]:
    """{backend: ms} of the backends that serve the point and agree with the reference."""
    want = None
    if point.check:
        with torch.no_grad():
            want = _outputs(dispatch.op(point.op, backend=REFERENCE)(*point.args, **point.kwargs))
    times = {}
    for backend in backends:
        handle = dispatch.op(point.op, backend=backend)
        if handle.select(*point.args, **point.kwargs).backend != backend:
            log(f"    {backend}: does not serve this shape")
            continue
        try:
            got = step(handle, point)  # also the first (compiling) call
            err = rel_err(got, want) if want is not None else 0.0
            if err > TOLERANCE[dtype]:
                log(f"    {backend}: MISMATCH with the reference (relative error {err:.2e}); not timed")
                continue
            times[backend] = timer.median_ms(lambda: step(handle, point))
        except Exception as exc:  # one backend failing (out of memory, say) must not end the whole run
            log(f"    {backend}: FAILED ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); not timed")
            continue
        log(f"    {backend}: {times[backend]:.3f} ms" + ("" if want is not None else " (not checked: too large)"))
    return times


def entry(point: Point, dtype: torch.dtype, times: dict[str, float], unavailable: dict[str, str]) -> dict:
    """A table entry; `unavailable` keeps it from ordering calls where one of those backends can serve."""
    n, rest = tuned.bucket_of(point.op, point.args, point.kwargs)
    fastest_first = sorted(times.items(), key=lambda item: item[1])
    return {"op": point.op, "dtype": dtype_name(dtype), "n": n, "bucket": tuned.describe_rest(rest),
            "shape": point.shape, "ms": {b: round(t, 4) for b, t in fastest_first}, "unavailable": unavailable}


def merged(path: Path, key: dict, entries: list[dict], log) -> list[dict]:
    """entries plus those of an existing table at `path` made with the same key (new ones win)."""
    if not path.exists():
        return entries
    try:
        old_key, old_entries = tuned.read_table(path)
    except tuned.TunedTableError as exc:
        log(f"overwriting {path}: {exc}")
        return entries
    if old_key != key:
        log(f"overwriting {path}: it was made on {tuned.describe_key(old_key)}")
        return entries
    fresh = {(e["op"], e["dtype"], e["n"], e["bucket"]) for e in entries}
    return [e for e in old_entries if (e["op"], e["dtype"], e["n"], e["bucket"]) not in fresh] + entries


def points(args, dtype: torch.dtype, device: torch.device):
    for op in args.ops:
        if op == "mhc_coeffs":
            for b, t, hc, c in args.mhc:
                yield mhc_point(b, t, hc, c, dtype, device)
            continue
        target_dtypes = [dtype] + ([torch.float32] if dtype != torch.float32 else [])
        for n in args.n:
            yield from lm_points(op, n, args.hidden, args.vocab, dtype, device, args.betas, target_dtypes)


def run(args, device: str, dtype: torch.dtype) -> int:
    device = torch.device(device)
    log = print
    key = tuned.device_key(device)
    log(f"tuning on {tuned.describe_key(key)}, {dtype_name(dtype)}")
    timer = Timer(device, args.reps, args.warmup)
    deadline = time.monotonic() + args.budget_s
    entries, left = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # a backend that falls back is reported, not timed
        for point in points(args, dtype, device):
            if time.monotonic() > deadline:
                left += 1
                continue
            log(f"  {point.op} {point.shape} {point.kwargs or ''}")
            usable, unavailable = backends_for(point.op, device, dtype)
            for backend, why in unavailable.items():
                log(f"    {backend}: NOT AVAILABLE here ({why}); the entry will not order calls where it is")
            times = measure(point, usable, timer, dtype, log)
            if times:
                entries.append(entry(point, dtype, times, unavailable))
            point = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if left:
        log(f"time budget ({args.budget_s:.0f} s) spent: {left} points not reached")
    out = Path(args.out)
    table = {"format": tuned.FORMAT, "key": key, "written": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "command": "python -m liger_dispatch " + " ".join(sys.argv[1:]),
        "entries": merged(out, key, entries, log)}
    out.write_text(tuned.dumps(table))
    selection.reset()  # the tables read, and the selections and handles' plans made from them
    log(f"wrote {len(entries)} entries to {out}; use it with {settings.TUNED_TABLE.name}={out.resolve()}")
    return 0


def _mhc_shape(text: str) -> tuple[int, int, int, int]:
    b, t, hc, c = (int(v) for v in text.lower().split("x"))
    return b, t, hc, c


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", nargs="+", default=list(DEFAULT_OPS), choices=list(tuned.BUCKETS))
    parser.add_argument("--n", nargs="+", type=int, default=list(DEFAULT_NS), help="rows of the LM-head ops")
    parser.add_argument("--hidden", type=int, default=4096, help="H of the LM-head ops (default: llama3's)")
    parser.add_argument("--vocab", type=int, default=128256, help="V of the LM-head ops (default: llama3's)")
    parser.add_argument("--betas", nargs="+", type=float, default=list(DEFAULT_BETAS), help="fused_linear_jsd betas")
    parser.add_argument("--mhc", nargs="+", type=_mhc_shape, default=list(DEFAULT_MHC), metavar="BxTxHCxC",
                        help="mhc_coeffs shapes (default: 4x512x4x1024 4x2048x4x4096)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions a backend and point (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls after the first")
    parser.add_argument("--budget-s", type=float, default=170.0, help="stop starting points after this long")
    parser.add_argument("--out", default="liger-tuned.json", help="the table to write (merged when its key matches)")
