"""The vocabulary-chunk driver, for an op whose upstream gradients are known only after its forward (an RL loss
comes after the per-token log-probs), so the gradient cannot be made in the forward's loop as fused_linear.py does.

Chunks are vocabulary slices, all rows each: a slice of dW (and db) is one GEMM over every row, rounded once as an
unchunked matmul's would be (chunks of rows would add into dW in its own dtype once a chunk: a bf16 error growing
with the chunk count, and dW re-read each chunk). dX sums over the slices in fp32. Slice statistics combine as a
vocab-parallel call's ranks' do.

Memory (`Layout`): [N, V] within LIGER_CHUNK_BUDGET_MB is kept whole, in a buffer of its own. Beyond it, the kept
logits live in the memory dW will take: one byte buffer holds dW in its first bytes, and since the backward writes
slice j of dW only after reading slice j's logits, those may lie where later slices of dW go. The buffer is dW's
size plus the budget (which then also counts dX's fp32 accumulator): every slice kept when they fit (always for
N <= H in one dtype: a slice's logits are no larger than its dW), else the first slices kept and the others
recomputed in the backward into a slice past dW (2 N H FLOPs a column). LIGER_CHUNK_COLUMNS forces the slice width.
The backward's dW is a view of the buffer at offset 0, so the bytes past it stay allocated as long as it does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from liger_dispatch import settings
from liger_dispatch.compose import grad_bounds
from liger_dispatch.compose.fused_linear import grad_dtype, linear_into

COLUMN_ALIGN = 128  # a slice width the GEMMs tile well
BYTE_ALIGN = 16
RECOMPUTE_SHARE = 4  # the recompute slice takes at most this fraction of the budget: its width


def _aligned(offset: int) -> int:
    return -(-offset // BYTE_ALIGN) * BYTE_ALIGN


@dataclass(frozen=True)
class Layout:
    """Where one call's logits ([rows, V] of `dtype`) go in its buffer of `nbytes` bytes: slice j ([start, end) of
    the vocabulary) at byte offsets[j] if kept (j < len(offsets)), else at `recompute`; dW [V, H] in the first
    `grad_bytes` (none: dW is not in the buffer)."""

    rows: int
    dtype: torch.dtype
    slices: tuple[tuple[int, int], ...]
    offsets: tuple[int, ...]
    recompute: int
    grad_bytes: int
    nbytes: int

    def _span(self, j: int) -> tuple[int, int]:
        start, end = self.slices[j]
        offset = self.offsets[j] if j < len(self.offsets) else self.recompute
        return offset, offset + self.rows * (end - start) * self.dtype.itemsize

    def logits(self, buffer: torch.Tensor, j: int) -> torch.Tensor:
        begin, finish = self._span(j)
        start, end = self.slices[j]
        return buffer[begin:finish].view(self.dtype).view(self.rows, end - start)

    def gaps(self) -> list[tuple[int, int]]:
        """The byte ranges no logits are written to (zeroed by the forward: the buffer is an output of the op, which
        must not depend on what memory held before)."""
        written = [self._span(j) for j in range(min(len(self.offsets) + 1, len(self.slices)))]
        gaps, at = [], 0
        for start, end in sorted(written) + [(self.nbytes, self.nbytes)]:
            if start > at:
                gaps.append((at, start))
            at = max(at, end)
        return gaps

    def grad_weight(self, buffer: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not self.grad_bytes:
            return torch.empty_like(weight, dtype=grad_dtype(weight))
        return buffer[:self.grad_bytes].view(grad_dtype(weight)).view(weight.shape)


def layout(x: torch.Tensor, weight: torch.Tensor) -> Layout:
    """The layout for the rows x [N, H] and the head weight [V, H] under the current settings (module docstring)."""
    (n_rows, hidden), vocab = x.shape, weight.shape[0]
    logit, grad = x.element_size(), grad_dtype(weight).itemsize
    grad_bytes = vocab * hidden * grad
    budget = int(settings.CHUNK_BUDGET_MB.get() * 2**20)
    width = settings.CHUNK_COLUMNS.get()
    if not width:
        width = vocab if n_rows * vocab * logit <= budget else max(
            COLUMN_ALIGN, budget // RECOMPUTE_SHARE // max(1, n_rows * logit) // COLUMN_ALIGN * COLUMN_ALIGN)
    # an empty vocabulary slice (vocab-parallel) is one empty chunk
    slices = tuple((start, min(start + width, vocab)) for start in range(0, vocab, width)) if vocab else ((0, 0),)
    sizes = [n_rows * (end - start) * logit for start, end in slices]
    if sum(sizes) <= budget:  # the logits alone fit: kept in a buffer of their own, dW made in the backward
        offsets = tuple(itertools.accumulate((_aligned(size) for size in sizes[:-1]), initial=0))
        return Layout(n_rows, x.dtype, slices, offsets, 0, 0, offsets[-1] + sizes[-1])
    limit = grad_bytes + budget - (n_rows * hidden * 4 if len(slices) > 1 else 0)
    offsets, end = [], 0
    for (_, end_column), size in zip(slices, sizes):  # past dW's slices 0..j (written before j is read), past j-1
        offsets.append(_aligned(max(end_column * hidden * grad, end)))
        end = offsets[-1] + size
    if end <= limit:
        return Layout(n_rows, x.dtype, slices, tuple(offsets), 0, grad_bytes, max(grad_bytes, end))

    def recompute_at(kept: int) -> int:  # past dW and the kept slices
        return _aligned(max(grad_bytes, offsets[kept - 1] + sizes[kept - 1] if kept else 0))

    kept = len(offsets)
    while kept and recompute_at(kept) + sizes[0] > limit:
        kept -= 1
    at = recompute_at(kept)
    return Layout(n_rows, x.dtype, slices, tuple(offsets[:kept]), at, grad_bytes, at + sizes[0])


def _rows_of(weight: torch.Tensor, bias: Optional[torch.Tensor], start: int, end: int):
    return weight[start:end], None if bias is None else bias[start:end]


def forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            stats_of: Callable[[torch.Tensor, int], torch.Tensor],
            combine: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row statistics over the whole vocabulary, the buffer `backward` takes: layout(x, weight)).

    stats_of(logits [N, end - start], start) -> [N, k]: one slice's statistics; combine([S, N, k]) -> [N, k]."""
    plan = layout(x, weight)
    buffer = torch.empty(plan.nbytes, dtype=torch.uint8, device=x.device)
    for start, end in plan.gaps():
        buffer[start:end].zero_()
    parts = []
    for j, (start, end) in enumerate(plan.slices):
        logits = plan.logits(buffer, j)
        linear_into(x, *_rows_of(weight, bias, start, end), logits)
        parts.append(stats_of(logits, start))
    return (parts[0] if len(parts) == 1 else combine(torch.stack(parts))), buffer


def backward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], buffer: torch.Tensor,
             grad_of: Callable[[torch.Tensor, int], None], *, want_dx: bool, want_dw: bool, want_db: bool,
             unscale: Optional[torch.Tensor] = None):
    """(dX, dW, db), None where not wanted; dW is a view of `buffer` (the forward's). grad_of(logits, start)
    overwrites one slice's logits with the gradient over them (times the fp16 buffer's factor, which `unscale`
    undoes: grad_bounds.py)."""
    plan = layout(x, weight)
    if buffer.numel() != plan.nbytes:
        raise RuntimeError("liger_dispatch: LIGER_CHUNK_BUDGET_MB or LIGER_CHUNK_COLUMNS changed between the forward "
                           f"and the backward of one call (its buffer holds {buffer.numel()} bytes, the settings now "
                           f"lay out {plan.nbytes})")
    several = len(plan.slices) > 1
    dx = (torch.zeros(x.shape, dtype=grad_bounds.wide(x), device=x.device) if several else torch.empty_like(x)
          ) if want_dx else None
    dw = plan.grad_weight(buffer, weight) if want_dw else None
    db = torch.empty(weight.shape[0], dtype=grad_bounds.wide(x), device=x.device) if want_db else None
    for j, (start, end) in enumerate(plan.slices):
        w_c, b_c = _rows_of(weight, bias, start, end)
        logits = plan.logits(buffer, j)
        if j >= len(plan.offsets):
            linear_into(x, w_c, b_c, logits)
        grad_of(logits, start)
        if dx is not None:
            _mm_into(logits, w_c, dx, accumulate=several)
        if dw is not None:
            _mm_into(logits.t(), x, dw[start:end], accumulate=False)
        if db is not None:
            torch.sum(logits, 0, dtype=db.dtype, out=db[start:end])
    if dx is not None:
        dx = dx.to(grad_dtype(x))
    if unscale is not None:
        for grad in (dx, dw, db):
            if grad is not None:
                grad.mul_(unscale)
    return dx, dw, db


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, accumulate: bool) -> None:
    """out (+)= a @ b, accumulated in out's dtype however a and b are stored (cuBLAS's fp32 output for bf16 / fp16
    operands on a GPU; the CPU's matmul has none, so it widens the operands)."""
    if a.dtype != out.dtype and not a.is_cuda:
        a, b = a.to(out.dtype), b.to(out.dtype)
    wider = {} if a.dtype == out.dtype else {"out_dtype": out.dtype}
    if accumulate:
        torch.addmm(out, a, b, out=out, **wider)
    else:
        torch.mm(a, b, out=out, **wider)
