"""Timing and memory of one callable, and the machine's two ceilings (matmul rate, copy bandwidth).

On a GPU: CUDA events around each repetition, as triton.testing.do_bench takes them, with L2 flushed and
gradients set to None before every call (with flush=False, no flush: what the previous repetition left in L2
stays). On the CPU (the harness's own tests): a host clock.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

L2_FLUSH_BYTES = 256 * 2**20  # what triton.testing.do_bench zeroes to flush L2
DEFAULT_L2_BYTES = 60 * 2**20


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


def _reset(grads: Sequence[torch.Tensor]) -> None:
    for t in grads:
        t.grad = None


def bench(fn: Callable, grads: Sequence[torch.Tensor], device: torch.device, *, warmup_ms: float, rep_ms: float,
          min_reps: int = 5, flush: bool = True) -> Timing:
    """Median and p20/p80 of `fn` after warm-up; at least `min_reps` timed repetitions, each after its gradients
    are reset and (unless flush=False) L2 is flushed, both outside the timed window."""
    _reset(grads)
    estimate = max(wall_ms(fn, device), 1e-3)  # also the first warm-up call
    rep_ms = max(rep_ms, min_reps * estimate)
    if device.type == "cuda":
        return _events(fn, grads, reps=max(min_reps, round(rep_ms / estimate)),
                       warmups=max(1, round(warmup_ms / estimate)), flush=flush)
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < min_reps or time.perf_counter() < deadline:
        _reset(grads)
        times.append(wall_ms(fn, device))
    return summarize(times)


def _events(fn: Callable, grads: Sequence[torch.Tensor], *, reps: int, warmups: int, flush: bool) -> Timing:
    """triton.testing.do_bench's measurement, with every call, its warm-up and estimate calls too, starting from
    reset gradients (do_bench's estimate loop does not reset them: a CUDA-graphed backward's last gradients are
    overwritten by the next replay, and autograd would read them to accumulate): CUDA events around each
    repetition, L2 flushed before it by zeroing a buffer larger than L2 (unless flush=False), one synchronization
    at the end."""
    cache = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush else None
    for _ in range(warmups):
        _reset(grads)
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        _reset(grads)
        if cache is not None:
            cache.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return summarize([start.elapsed_time(end) for start, end in events])


def summarize(values: Sequence[float]) -> Timing:
    """Median, p20 and p80 of at least two measurements."""
    q = statistics.quantiles(values, n=10, method="inclusive")
    return Timing(statistics.median(values), q[1], q[7])


def peak_mb(fn: Callable, grads: Sequence[torch.Tensor], device: torch.device) -> Optional[float]:
    """Peak memory allocated during one call above what was allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    _reset(grads)
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def matmul_tflops(device: torch.device, rep_ms: float) -> float:
    """bf16 GEMM rate (8192^3 on a GPU; fp32 1024^3 on the CPU, only so the harness runs there)."""
    size, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=gen).to(dtype)
    b = torch.randn(size, size, device=device, generator=gen).to(dtype)
    t = bench(lambda: a @ b, [], device, warmup_ms=rep_ms, rep_ms=rep_ms)
    return 2 * size**3 / (t.ms * 1e-3) / 1e12


def copy_gbps(device: torch.device, rep_ms: float) -> float:
    """Device-to-device copy bandwidth, bytes read plus written (1 GiB on a GPU, 64 MiB on the CPU)."""
    nbytes = 2**30 if device.type == "cuda" else 2**26
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), [], device, warmup_ms=rep_ms, rep_ms=rep_ms)
    return 2 * nbytes / (t.ms * 1e-3) / 1e9


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
