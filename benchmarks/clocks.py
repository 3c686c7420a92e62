"""The benchmarks' clocks beside the timing they share with tune (liger_dispatch.timing): peak memory of a call, the
GPU's matmul rate and copy bandwidth (the roofline), and host clocks (perf_counter around the call, the stream
synchronized before and after): what a call costs the CPU, calls back to back (host- or GPU-bound, whichever
binds), kernels per call from torch.profiler, a CUDA graph's replay time."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from liger_dispatch.timing import bench, cuda_graph, reset_grads, synchronize


def peak_mb(fn: Callable, grads: Sequence[torch.Tensor], device: torch.device) -> Optional[float]:
    """Peak memory allocated during one call above what was allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    reset_grads(grads)
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


def host_us(fn: Callable, device: torch.device, calls: int, grads: Sequence[torch.Tensor] = ()) -> float:
    """Median host time of one call, the stream idle when it starts (nothing waits for room in the queue);
    `grads` are reset before each call, outside the timed window."""
    times = []
    for _ in range(calls):
        reset_grads(grads)
        synchronize(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    synchronize(device)
    reset_grads(grads)
    return statistics.median(times) * 1e6


def loop_us(fn: Callable, device: torch.device, calls: int, args: tuple = ()) -> float:
    """Per call of fn(*args), of `calls` calls back to back and one synchronization at each end."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    synchronize(device)
    return (time.perf_counter() - start) / calls * 1e6


def wall_us(fn: Callable, device: torch.device, calls: int) -> float:
    """The best of three loop_us: host- or GPU-bound, whichever binds."""
    return min(loop_us(fn, device, calls) for _ in range(3))


def kernels(fn: Callable, device: torch.device, calls: int = 1,
            grads: Sequence[torch.Tensor] = ()) -> Optional[list[tuple[str, float]]]:
    """(name, us) of every CUDA kernel and memset `calls` calls issue (torch.profiler), `grads` reset before each
    call (autograd would otherwise add the new gradient into the old one); None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            reset_grads(grads)
            fn()
        synchronize(device)
    reset_grads(grads)
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def graph_us(fn: Callable, device: torch.device, calls: int) -> Optional[float]:
    """Per replay of fn captured in one CUDA graph (cuda_graph), replays back to back: the GPU's time for the call
    with no host in the way; None off CUDA."""
    if device.type != "cuda":
        return None
    return wall_us(cuda_graph(fn)[0].replay, device, calls)
