"""The class-index check of a loss's labels on the device: four launches, no host sync, capturable.

Each label must be ignore_index or in [0, V). With the sorted edges [ignore_index, ignore_index + 1, 0, V]
(just [0, V] when ignore_index is in range), the number of edges <= t (`bucketize(..., right=True)`) is odd
exactly for valid labels: 1 at ignore_index, 3 in [0, V) when ignore_index < 0; 1 in [0, V), 3 at ignore_index
when ignore_index >= V. So the check is bucketize, `& 1`, `all` and one `_assert_async`, against the seven
launches of `(t == ignore) | ((t >= 0) & (t < V))`. The edges are kept per (device, V, ignore_index), filled on
the device (no host-to-device copy).
"""

from __future__ import annotations

import torch

_LIMIT = 256
_edges: dict[tuple, torch.Tensor] = {}


def edges(vocab: int, ignore_index: int) -> list[int]:
    """The sorted bucket edges that make a valid label's bucket odd."""
    if 0 <= ignore_index < vocab:
        return [0, vocab]
    return sorted([ignore_index, ignore_index + 1, 0, vocab])


def _edges_on(device: torch.device, vocab: int, ignore_index: int) -> torch.Tensor:
    key = (device, vocab, ignore_index)
    cached = _edges.get(key)
    if cached is not None:
        return cached
    values = edges(vocab, ignore_index)
    tensor = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, value in enumerate(values):
        tensor[i].fill_(value)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return tensor  # filled only when the graph replays: not for eager calls to reuse
    if len(_edges) >= _LIMIT:
        _edges.clear()
    _edges[key] = tensor
    return tensor


def assert_class_indices(name: str, target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """A device-side assert that every entry of target is in [0, vocab) or ignore_index."""
    buckets = torch.bucketize(target, _edges_on(target.device, vocab, ignore_index), right=True, out_int32=True)
    torch._assert_async(buckets.bitwise_and_(1).all(),
                        f"{name} holds a class index outside [0, {vocab}) that is not ignore_index ({ignore_index}); "
                        "LIGER_CHECKS=full names it")
