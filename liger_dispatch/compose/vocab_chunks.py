"""The vocabulary-chunk driver: for an op whose backward runs after its forward, because its upstream gradients
are known only then (an RL loss comes after the per-token log-probs), so the gradient cannot be made in the
forward's chunk loop as fused_linear.py makes it.

Its chunks are slices of the vocabulary, all rows each: a slice of dW (and db) is one GEMM over every row, written
once and rounded once, as an unchunked matmul's would be, where chunks of rows would add into dW in its own dtype
once a chunk (a bf16 error growing with the chunk count, and dW re-read and re-written every chunk). dX sums over
the slices in fp32. The slices' row statistics combine as the ranks' of a vocab-parallel call do.

Memory: LIGER_CHUNK_BUDGET_MB holds one logits buffer [N, Vc] (LIGER_CHUNK_COLUMNS forces Vc), which the forward
fills with the first slice last and hands to the backward (that slice's GEMM is not made again; the others are
recomputed into the same buffer: 2 N H (V - Vc) FLOPs), and, with two slices or more, dX's fp32 accumulator [N, H].
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from liger_dispatch import settings
from liger_dispatch.compose import grad_bounds
from liger_dispatch.compose.fused_linear import grad_dtype, linear_into

COLUMN_ALIGN = 128  # a slice width the GEMMs tile well


def column_chunks(x: torch.Tensor, vocab: int) -> list[tuple[int, int]]:
    """The slices [start, end) of the vocabulary for the rows of x, the first one the widest: as few as the budget
    allows, balanced. With several, dX's fp32 accumulator counts against the budget too."""
    width = settings.CHUNK_COLUMNS.get()
    if not width:
        budget = settings.CHUNK_BUDGET_MB.get() * 2**20
        n_rows, bytes_per_logit = x.shape[0], x.element_size()
        if n_rows * vocab * bytes_per_logit <= budget:
            return [(0, vocab)]
        budget -= x.numel() * 4
        limit = max(COLUMN_ALIGN, int(budget // (n_rows * bytes_per_logit)) // COLUMN_ALIGN * COLUMN_ALIGN)
        width = math.ceil(math.ceil(vocab / math.ceil(vocab / limit)) / COLUMN_ALIGN) * COLUMN_ALIGN
    return _slices(vocab, width)


def _slices(vocab: int, width: int) -> list[tuple[int, int]]:
    if not vocab:  # an empty vocabulary slice (vocab-parallel): one empty chunk
        return [(0, 0)]
    return [(start, min(start + width, vocab)) for start in range(0, vocab, width)]


def _slice(buffer: torch.Tensor, columns: int) -> torch.Tensor:
    """A contiguous [N, columns] view at the start of the buffer's storage (a narrower slice than the first)."""
    return buffer.view(-1)[: buffer.shape[0] * columns].view(buffer.shape[0], columns)


def _rows_of(weight: torch.Tensor, bias: Optional[torch.Tensor], start: int, end: int):
    return weight[start:end], None if bias is None else bias[start:end]


def forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            stats_of: Callable[[torch.Tensor, int], torch.Tensor],
            combine: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row statistics over the whole vocabulary, the first slice's logits, kept for `backward`).

    stats_of(logits [N, end - start], start) -> [N, k]: one slice's statistics; combine([S, N, k]) -> [N, k]."""
    chunks = column_chunks(x, weight.shape[0])
    buffer = torch.empty(x.shape[0], chunks[0][1] - chunks[0][0], dtype=x.dtype, device=x.device)
    parts = []
    for start, end in chunks[1:] + chunks[:1]:  # the first slice last: its logits stay in the buffer
        logits = _slice(buffer, end - start)
        linear_into(x, *_rows_of(weight, bias, start, end), logits)
        parts.append(stats_of(logits, start))
    return (parts[0] if len(parts) == 1 else combine(torch.stack(parts))), buffer


def backward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], kept: torch.Tensor,
             grad_of: Callable[[torch.Tensor, int], None], *, want_dx: bool, want_dw: bool, want_db: bool,
             unscale: Optional[torch.Tensor] = None):
    """(dX, dW, db), None where not wanted. grad_of(logits, start) overwrites one slice's logits with the gradient
    over them (times the fp16 buffer's factor, which `unscale` undoes: grad_bounds.py). The slices are the
    forward's, read off the kept buffer (the first slice, the widest)."""
    chunks = _slices(weight.shape[0], kept.shape[1])
    several = len(chunks) > 1
    dx = (torch.zeros(x.shape, dtype=grad_bounds.wide(x), device=x.device) if several else torch.empty_like(x)
          ) if want_dx else None
    dw = torch.empty_like(weight, dtype=grad_dtype(weight)) if want_dw else None
    db = torch.empty(weight.shape[0], dtype=grad_bounds.wide(x), device=x.device) if want_db else None
    for i, (start, end) in enumerate(chunks):
        w_c, b_c = _rows_of(weight, bias, start, end)
        logits = kept if i == 0 else _slice(kept, end - start)
        if i:
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
