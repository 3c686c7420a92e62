"""The class-index check of a loss's labels on the device: no host sync, capturable.

On a GPU it is one Triton launch whose programs each test a block of labels and stop the device on a bad one
(`tl.device_assert`, compiled in through the kernel's debug flag), as torch's own cross-entropy kernels do. Without
Triton it falls back to torch ops:

Each label must be ignore_index or in [0, V). With the sorted edges [ignore_index, ignore_index + 1, 0, V]
(just [0, V] when ignore_index is in range), the number of edges <= t (`bucketize(..., right=True)`) is odd
exactly for valid labels: 1 at ignore_index, 3 in [0, V) when ignore_index < 0; 1 in [0, V), 3 at ignore_index
when ignore_index >= V. So the check is bucketize, `& 1`, `all` and one `_assert_async`, against the seven
launches of `(t == ignore) | ((t >= 0) & (t < V))`. The edges (filled on the device: no host-to-device copy) and
the message are kept per (name, device, V, ignore_index).
"""

from __future__ import annotations

import functools

import torch

_LIMIT = 256
_checks: dict[tuple, tuple[torch.Tensor, str]] = {}  # (name, device, V, ignore_index) -> (edges, assert message)


def edges(vocab: int, ignore_index: int) -> list[int]:
    """The sorted bucket edges that make a valid label's bucket odd."""
    if 0 <= ignore_index < vocab:
        return [0, vocab]
    return sorted([ignore_index, ignore_index + 1, 0, vocab])


def _check_for(name: str, device: torch.device, vocab: int, ignore_index: int) -> tuple[torch.Tensor, str]:
    key = (name, device, vocab, ignore_index)
    cached = _checks.get(key)
    if cached is not None:
        return cached
    values = edges(vocab, ignore_index)
    tensor = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, value in enumerate(values):
        tensor[i].fill_(value)
    check = (tensor, f"{name} holds a class index outside [0, {vocab}) that is not ignore_index ({ignore_index}); "
                     "LIGER_CHECKS=full names it")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return check  # its edges are filled only when the graph replays: not for eager calls to reuse
    if len(_checks) >= _LIMIT:
        _checks.clear()
    _checks[key] = check
    return check


_BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _kernel():
    """The Triton check kernel, or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(debug=True)  # tl.device_assert is compiled in only in debug mode
    def check_kernel(T, n, vocab, ignore_index, MESSAGE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        t = tl.load(T + offs, mask=offs < n, other=0).to(tl.int64)
        tl.device_assert((t == ignore_index) | ((t >= 0) & (t < vocab)), MESSAGE)

    return check_kernel


def launch_check(kernel, name: str, target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The Triton check of a 1-D contiguous target (the interpreters run it on CPU tensors)."""
    n = target.numel()
    if n:
        message = f"{name} holds a class index outside [0, V) that is not ignore_index; LIGER_CHECKS=full names it"
        kernel[(-(-n // _BLOCK),)](target, n, vocab, ignore_index, MESSAGE=message, BLOCK=_BLOCK, num_warps=4)


def assert_class_indices(name: str, target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """A device-side assert that every entry of target is in [0, vocab) or ignore_index."""
    kernel = _kernel() if target.is_cuda else None
    if kernel is not None:
        launch_check(kernel, name, target.reshape(-1), vocab, ignore_index)
        return
    bounds, message = _check_for(name, target.device, vocab, ignore_index)
    buckets = torch.bucketize(target, bounds, right=True, out_int32=True)
    torch._assert_async(buckets.bitwise_and_(1).all(), message)
