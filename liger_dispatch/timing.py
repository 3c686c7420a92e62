"""How a backend is measured, by `python -m liger_dispatch tune` and the benchmark harness (benchmarks/) alike:
one call's forward and backward, its agreement with a reference (the relative norm of the difference, NaN when an
output is missing, misshapen or not finite, so it never passes a tolerance), its time, and the host clocks.

Time on a GPU: CUDA events around each repetition, as triton.testing.do_bench takes them, with L2 flushed and
gradients set to None before every call, both outside the timed window (flush=False keeps what the previous
repetition left in L2: a repeated training step); median and p20/p80. On the CPU (the tests): a host clock.
The benchmarks' other clocks are in benchmarks/clocks.py.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

L2_FLUSH_BYTES = 256 * 2**20  # what triton.testing.do_bench zeroes to flush L2
DEFAULT_L2_BYTES = 60 * 2**20
MAX_INPUT_COPIES = 8
WARMUP_MS = 25.0  # the harness's and tune's defaults: warm-up, timed repetitions' total, rounds
# A 17-20 ms step (N = 4096 on the H200) is bimodal within ~10 %: 100 ms gave each provider 5-6 samples and medians
# 6 % apart for one configuration; 500 ms gives ~25 and agreement within 2 %.
REP_MS = 500.0
ROUNDS = 5
# ||got - want|| / ||want||; bf16/fp16 operands land between 1e-3 and 1e-2, fp32 (or tf32 inside) near 3e-4.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 2e-3}


@dataclass
class Inputs:
    """One call's arguments, the leaves whose gradients it makes, and the upstream gradients of its outputs."""

    args: tuple
    kwargs: dict
    leaves: list[torch.Tensor]
    upstream: Optional[tuple[torch.Tensor, ...]] = None  # grads fed to backward when the op has several outputs

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.args if isinstance(t, torch.Tensor))


def forward(fn: Callable, inputs: Inputs):
    return fn(*inputs.args, **inputs.kwargs)


def outputs(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def backward(out, inputs: Inputs, retain_graph: bool = False) -> None:
    torch.autograd.backward(outputs(out), inputs.upstream, retain_graph=retain_graph)


def reset_grads(grads: Sequence[torch.Tensor]) -> None:
    for t in grads:
        t.grad = None


@dataclass
class Result:
    """What one call produced: its outputs and the gradients of the inputs' leaves (empty in fwd mode)."""

    outs: list[torch.Tensor]
    grads: list[Optional[torch.Tensor]]


def run(fn: Callable, inputs: Inputs, mode: str = "fwd+bwd") -> Result:
    """One call on `inputs` in `mode` (fwd: no autograd); leaves' grads are reset before and after."""
    reset_grads(inputs.leaves)
    if mode == "fwd":
        with torch.no_grad():
            return Result([o.detach() for o in outputs(forward(fn, inputs))], [])
    out = forward(fn, inputs)
    backward(out, inputs)
    grads = [leaf.grad for leaf in inputs.leaves]
    reset_grads(inputs.leaves)
    return Result([o.detach() for o in outputs(out)], grads)


def input_copies(nbytes: int, l2: int) -> int:
    """Input sets to rotate over so that one call's inputs are not still in L2 from the last (2x L2 in all)."""
    return min(MAX_INPUT_COPIES, max(1, math.ceil(2 * l2 / max(nbytes, 1))))


def step(fn: Callable, sets: Sequence[Inputs], mode: str = "fwd+bwd") -> Callable[[], None]:
    """One timed repetition of `fn` in `mode` on the next input set. bwd: the forward graphs are built once, here,
    outside the timing, and backward keeps them for the next turn."""
    if mode == "bwd":
        graphs = itertools.cycle([(forward(fn, inputs), inputs) for inputs in sets])
        return lambda: backward(*next(graphs), retain_graph=True)
    turn = itertools.cycle(sets)
    if mode == "fwd":
        def forward_only() -> None:
            with torch.no_grad():
                forward(fn, next(turn))

        return forward_only

    def forward_backward() -> None:
        inputs = next(turn)
        backward(forward(fn, inputs), inputs)

    return forward_backward


def rel_err(got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> float:
    """||got - want|| / ||want|| in float64 (||got|| when want is all zero); NaN when `got` is missing, misshapen or
    not finite. One float64 temporary at a time: the difference is taken in place in got's copy."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else math.nan
    if got.shape != want.shape:
        return math.nan
    diff = torch.linalg.vector_norm(got.detach().to(torch.float64, copy=True).sub_(want.detach())).item()
    scale = torch.linalg.vector_norm(want.detach(), dtype=torch.float64).item()
    if not math.isfinite(diff):
        return math.nan
    return diff / scale if scale > 0 else diff


def compare(got: Result, want: Result) -> tuple[float, float]:
    """(worst output error, worst gradient error); NaN propagates."""
    def worst(pairs):
        errs = [rel_err(g, w) for g, w in pairs]
        return max(errs, key=lambda e: math.inf if math.isnan(e) else e, default=0.0)

    if len(got.outs) != len(want.outs):
        return math.nan, math.nan
    return worst(zip(got.outs, want.outs)), worst(zip(got.grads, want.grads))


def passes(errors: tuple[float, float], dtype: torch.dtype) -> bool:
    return all(e <= TOLERANCE[dtype] for e in errors)  # NaN compares False


@dataclass(frozen=True)
class Timing:
    ms: float
    p20: float
    p80: float


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn: Callable, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def bench(fn: Callable, grads: Sequence[torch.Tensor], device: torch.device, *, warmup_ms: float, rep_ms: float,
          min_reps: int = 5, flush: bool = True) -> Timing:
    """Median and p20/p80 of `fn`'s timed repetitions (at least `min_reps`) after warm-up, as the module says."""
    return summarize(samples(fn, grads, device, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps, flush=flush))


def samples(fn: Callable, grads: Sequence[torch.Tensor], device: torch.device, *, warmup_ms: float, rep_ms: float,
            min_reps: int = 5, flush: bool = True) -> list[float]:
    """bench's timed repetitions, in ms, one a call."""
    reset_grads(grads)
    estimate = wall_ms(fn, device)  # also the first warm-up call
    warmups, reps = calls(estimate, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps)
    if device.type == "cuda":
        return _events(fn, grads, reps=reps, warmups=warmups, flush=flush)
    times = []
    deadline = time.perf_counter() + max(rep_ms, min_reps * estimate) / 1e3
    while len(times) < min_reps or time.perf_counter() < deadline:
        reset_grads(grads)
        times.append(wall_ms(fn, device))
    return times


def calls(estimate_ms: float, *, warmup_ms: float, rep_ms: float, min_reps: int) -> tuple[int, int]:
    """(warm-up calls, timed repetitions) samples makes on a GPU after its first call, which took estimate_ms."""
    estimate = max(estimate_ms, 1e-3)
    return max(1, round(warmup_ms / estimate)), max(min_reps, round(rep_ms / estimate))


def round_share(r: int, rounds: int, *, warmup_ms: float, rep_ms: float, min_reps: int) -> dict:
    """Round r's share (see turns): the warm-up in the first round only, rep_ms and min_reps split over `rounds`."""
    return {"warmup_ms": warmup_ms if r == 0 else 0.0, "rep_ms": rep_ms / rounds,
            "min_reps": math.ceil(min_reps / rounds)}


def round_samples(fn: Callable, grads: Sequence[torch.Tensor], device: torch.device, r: int, rounds: int, *,
                  warmup_ms: float, rep_ms: float, min_reps: int = 5, flush: bool = True) -> list[float]:
    """samples for round r of `rounds`, given its round_share."""
    return samples(fn, grads, device, flush=flush,
                   **round_share(r, rounds, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps))


def rounds_calls(ms: float, rounds: int, *, warmup_ms: float, rep_ms: float, min_reps: int) -> int:
    """Calls round_samples makes on a GPU over all `rounds` rounds of a callable taking `ms` a call."""
    return sum(1 + sum(calls(ms, **round_share(r, rounds, warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=min_reps)))
               for r in range(rounds))


def turns(items: list, rounds: int) -> Iterator[tuple[int, object]]:
    """(round, item): `rounds` passes over `items` (read afresh at each pass, so an item removed stays out), each
    starting one item later; what times several callables in turn, so that a drift of the GPU's clocks over the
    measurement reaches all of them alike."""
    for r in range(rounds):
        k = r % len(items) if items else 0
        for item in (*items[k:], *items[:k]):
            yield r, item


def _events(fn: Callable, grads: Sequence[torch.Tensor], *, reps: int, warmups: int, flush: bool) -> list[float]:
    """triton.testing.do_bench's measurement, but every call starts from reset gradients (a CUDA-graphed backward's
    last gradients are overwritten by the next replay, and autograd would read them to accumulate)."""
    cache = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush else None
    for _ in range(warmups):
        reset_grads(grads)
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        reset_grads(grads)
        if cache is not None:
            cache.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def summarize(values: Sequence[float]) -> Timing:
    """Median, p20 and p80 (a single measurement is all three)."""
    if len(values) < 2:
        return Timing(values[0], values[0], values[0])
    q = statistics.quantiles(values, n=10, method="inclusive")
    return Timing(statistics.median(values), q[1], q[7])


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_L2_BYTES
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", DEFAULT_L2_BYTES)


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory a new allocation can still get (None off CUDA)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def host_free_bytes() -> Optional[int]:
    """Physical memory the host has free now (None where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cuda_graph(fn: Callable, warmups: int = 3) -> tuple[torch.cuda.CUDAGraph, object]:
    """(fn captured in a CUDA graph, what the captured call returned); fn is first run `warmups` times on a side
    stream, outside the capture, as torch.cuda.graph asks (first-call planning, compilation, allocations)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
