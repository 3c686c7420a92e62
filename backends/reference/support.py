"""Reference check_class_indices, scale_grad and valid_rows: torch ops, no host sync (registry/support.py).

The label check: with the sorted edges [ignore_index, ignore_index + 1, 0, V] (just [0, V] when ignore_index is in
range), the number of edges <= t (`bucketize(..., right=True)`) is odd exactly for valid labels: 1 at ignore_index,
3 in [0, V) when ignore_index < 0; 1 in [0, V), 3 at ignore_index when ignore_index >= V. So the check is
bucketize, `& 1`, `all` and one `_assert_async`, against the seven launches of `(t == ignore) | ((t >= 0) & (t <
V))`. The edges (filled on the device: no host-to-device copy) and the message are kept per (name, device, V,
ignore_index).
"""

from __future__ import annotations

import torch

from liger_dispatch import register_backend

from ._support import CAPABILITY, PRIORITY

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


@register_backend("check_class_indices", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def check_class_indices(target, *, vocab, ignore_index, name="target"):
    if target.numel() == 0:
        return
    bounds, message = _check_for(name, target.device, vocab, ignore_index)
    buckets = torch.bucketize(target, bounds, right=True, out_int32=True)
    torch._assert_async(buckets.bitwise_and_(1).all(), message)


@register_backend("scale_grad", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def scale_grad(grad, grad_loss):
    """The product in fp32, rounded once to the gradient's dtype, as the Triton kernel does."""
    grad.copy_(grad.float() * grad_loss.float())


@register_backend("valid_rows", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def valid_rows(target, *, ignore_index, scale=1.0, losses=None):
    count = (target != ignore_index).sum(dtype=torch.float32).clamp_min_(1)
    inverse = torch.full_like(count, scale) / count  # IEEE division, as the Triton kernel's
    if losses is None:
        return torch.stack((count, inverse))
    return torch.stack((count, inverse, losses.sum() * inverse))
