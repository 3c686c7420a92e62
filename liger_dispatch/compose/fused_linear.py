"""The chunk driver of the fused-linear losses: what every op family's composition runs, for every backend.

Per chunk of rows: logits = x_c @ W.T (+ bias) by cuBLAS into one reused buffer; the backend's kernel-level op
overwrites it with d(loss)/d(logits) and returns the per-row loss; then dX_c = G @ W and dW += G.T @ x_c (addmm in
place). Scalar reductions make the gradient in the forward; reduction="none" runs the loop again in the backward
with the per-row grad_output as row weights (the gradient of sum_i w_i loss_i).

Rows per chunk come from a memory budget for the logits buffers (LIGER_CHUNK_BUDGET_MB, default 512), so a small
batch is one chunk rather than launch-bound pieces; LIGER_CHUNK_ROWS forces a count (tests, tuning). Running the
loss kernel on a second stream to overlap the GEMMs measured 0.1-2.3 ms slower on the H200 (benchmarks/NOTES.md).

Vocab-parallel (vocab_parallel.py): `weight` is this rank's vocabulary slice; the VocabShard passed as
`vocab_parallel` sizes chunks for the widest slice (all ranks make the same collectives), makes the fp16 gradient
bound hold on every slice and sums dX over the ranks.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from liger_dispatch.compose import grad_bounds
from liger_dispatch.core import calls
from liger_dispatch.core.table import TABLE
from liger_dispatch import settings

ROW_ALIGN = 64


def one_chunk(n_rows: int, vocab: int, bytes_per_logit: int) -> bool:
    """Whether rows of this many logits (bytes_per_logit: what a chunk keeps per logit) run as one chunk."""
    return chunk_rows(n_rows, vocab, bytes_per_logit) >= n_rows


def keeps_whole_grad(n_rows: int, vocab: int, bytes_per_logit: int, extra_bytes_per_logit: int,
                     weight_grad_bytes_per_class: int) -> bool:
    """Whether a traced call keeps the logits' gradient G [N, V] of all its rows for its backward (run_chunks'
    logits_grad): they run as one chunk, or, no chunk size forced, G is no larger than the weight's gradient it
    replaces and the forward's logits (a teacher's included: extra_bytes_per_logit) no larger than two of those.
    Such a call holds at most two dW-sized tensors (G and dW while the backward's GEMM makes dW: at a 128k x 4k
    bf16 head and N = 4096, 0.5 GB above the chunked peak), and in exchange its backward makes no copy pass over a
    saved dW (inductor makes one over a saved tensor a backward op scales in place) and its forward accumulates no
    dW chunk by chunk."""
    if one_chunk(n_rows, vocab, bytes_per_logit + extra_bytes_per_logit):
        return True
    return not settings.CHUNK_ROWS.get() and n_rows * bytes_per_logit <= weight_grad_bytes_per_class and (
        n_rows * (bytes_per_logit + extra_bytes_per_logit) <= 2 * weight_grad_bytes_per_class)


def chunk_rows(n_rows: int, vocab: int, bytes_per_logit: int) -> int:
    """Rows per chunk: the largest aligned count whose logits buffers fit the budget, balanced over chunks."""
    forced = settings.CHUNK_ROWS.get()
    if forced:
        return max(1, min(forced, n_rows))
    budget = settings.CHUNK_BUDGET_MB.get() * 2**20
    limit = max(ROW_ALIGN, int(budget // max(1, vocab * bytes_per_logit)) // ROW_ALIGN * ROW_ALIGN)
    if n_rows <= limit:
        return max(n_rows, 1)
    n_chunks = math.ceil(n_rows / limit)
    return math.ceil(math.ceil(n_rows / n_chunks) / ROW_ALIGN) * ROW_ALIGN


def grad_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of t's gradient leaving the forward: fp32 for fp16 t, since the unscaled gradient (grad_loss = 1)
    may overflow fp16 where the one autograd scales by grad_loss and casts to t's dtype does not; else t's dtype."""
    return torch.float32 if t.dtype == torch.float16 else t.dtype


class _WeightGrad:
    """dW accumulated over chunks: the first chunk writes, the next ones addmm in place."""

    def __init__(self, weight: torch.Tensor, accum_dtype: Optional[torch.dtype]):
        self.weight = weight
        self.dtype = accum_dtype or weight.dtype
        self.out_dtype = grad_dtype(weight)
        self.value: Optional[torch.Tensor] = None

    def add(self, grad_logits: torch.Tensor, x: torch.Tensor) -> None:
        g_t = grad_logits.t()
        if self.dtype == grad_logits.dtype:
            if self.value is None:
                self.value = torch.mm(g_t, x)
            else:
                self.value.addmm_(g_t, x)
            return
        if self.value is None:  # an accumulator of another dtype: zeros, then addmm into it
            self.value = torch.zeros(g_t.shape[0], x.shape[1], dtype=self.dtype, device=x.device)
        if x.is_cuda:
            torch.addmm(self.value, g_t, x, out_dtype=self.dtype, out=self.value)
        else:
            self.value.addmm_(g_t.to(self.dtype), x.to(self.dtype))

    def result(self, unscale: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.value is None:  # no chunk ran: an empty batch
            return torch.zeros_like(self.weight, dtype=self.out_dtype)
        if unscale is not None:  # the accumulator is fp32 then
            self.value.mul_(unscale)
        return self.value.to(self.out_dtype)


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def run_chunks(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], grad_scale: Optional[torch.Tensor],
               chunk_loss: Callable[[torch.Tensor, int, int, torch.Tensor], torch.Tensor], *,
               row_bound: Callable[[], grad_bounds.Bound], extra_bytes_per_logit: int = 0, want_dx: bool,
               want_dw: bool, want_db: bool, accum_dtype: Optional[torch.dtype] = None, vocab_parallel=None,
               logits_grad: bool = False):
    """Runs the chunk loop: (loss_rows fp32 [N], dx, dw, db), None for an unwanted gradient. chunk_loss(logits, start,
    end, scale) overwrites logits with scale times their gradient and returns the per-row loss; grad_scale (0-d or [N],
    on the device, or None: 1) weights the rows. row_bound: a bound of each row's gradient L1 norm (the family's grad_bound), asked
    for fp16 inputs only. extra_bytes_per_logit: what chunk_loss keeps per logit (a teacher's logits), for the budget.
    vocab_parallel: the VocabShard of a vocab-parallel call, or None. logits_grad (asked with want_dw, without an fp16
    gradient factor, where keeps_whole_grad allows: heads.keeps_logits_grad): the rows run as one chunk and the
    logits' gradient [N, V] takes dW's place (dW = its transpose @ x), left for the backward."""
    n, vocab = x.shape[0], weight.shape[0]
    kernel_scale, unscale = grad_scale, None
    if x.dtype == torch.float16 and n > 0 and (want_dx or want_dw or want_db):
        bound = row_bound() if vocab_parallel is None else vocab_parallel.bound_over_ranks(row_bound, x, vocab)
        if vocab:  # an empty vocabulary slice (vocab-parallel) writes no gradient
            if grad_scale is None:
                grad_scale = torch.ones((), device=x.device)
            kernel_scale, unscale = grad_bounds.split_scale(grad_scale, bound, weight)
            accum_dtype = torch.float32
    rows = n if logits_grad else chunk_rows(n, vocab if vocab_parallel is None else vocab_parallel.widest,
                                            x.element_size() + extra_bytes_per_logit)
    buffer = torch.empty(min(rows, n), vocab, dtype=x.dtype, device=x.device)
    dx = torch.empty_like(x) if want_dx else None
    dw = _WeightGrad(weight, accum_dtype) if want_dw and not logits_grad else None
    db = torch.zeros(vocab, dtype=grad_bounds.wide(x), device=x.device) if want_db else None
    losses = []
    for start in range(0, n, rows):
        end = min(start + rows, n)
        x_c, logits = chunk_of(x, start, end), chunk_of(buffer, 0, end - start)
        linear_into(x_c, weight, bias, logits)
        losses.append(chunk_loss(logits, start, end, kernel_scale if kernel_scale is None or not kernel_scale.dim()
                                 else chunk_of(kernel_scale, start, end)))
        if dx is not None:
            torch.mm(logits, weight, out=chunk_of(dx, start, end))
        if dw is not None:
            dw.add(logits, x_c)
        if db is not None:
            db += logits.sum(0, dtype=db.dtype)
    if not losses:  # an empty batch
        losses.append(torch.zeros(0, dtype=torch.float32, device=x.device))
    loss_rows = losses[0] if len(losses) == 1 else torch.cat(losses)
    if dx is not None:
        dx = dx.to(grad_dtype(x))
    if unscale is not None:
        for grad in (dx, db):
            if grad is not None:
                grad.mul_(unscale)
    if dx is not None and vocab_parallel is not None:
        vocab_parallel.sum_over_ranks(dx)
    if logits_grad:
        assert unscale is None, "logits_grad is asked only without an fp16 gradient factor"
        return loss_rows, dx, buffer, db
    return loss_rows, dx, (dw.result(unscale) if dw is not None else None), db


def chunk_of(t: Optional[torch.Tensor], start: int, end: int) -> Optional[torch.Tensor]:
    """t's rows [start, end), or t itself when those are all of its rows (one chunk: no view made per call)."""
    return t if t is None or (start == 0 and end == t.shape[0]) else t[start:end]


def valid_count(labels: torch.Tensor, ignore_index: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, scale / count) as fp32 device scalars, count the non-ignored rows, at least 1 (all ignored -> loss 0,
    not NaN): one launch (registry/support.py's valid_rows), no sync."""
    return calls.machinery(TABLE.spec("valid_rows"), (labels,), dict(ignore_index=ignore_index, scale=scale)).unbind()


def mean_after(losses: torch.Tensor, labels: Optional[torch.Tensor], ignore_index: int, scale: float = 1.0
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(scale times the mean of per-row losses over the rows not ignored, their count; all rows and None without
    labels), computed after the rows (a call without gradients: no scale was needed before them): with labels and
    fp32 losses one launch, valid_rows given the losses."""
    if labels is None:
        return losses.sum() * (scale / max(losses.shape[0], 1)), None
    if losses.dtype != torch.float32:  # float64's: the count first, the sum in their own dtype
        count, inverse = valid_count(labels, ignore_index, scale)
        return losses.sum() * inverse, count
    stats = calls.machinery(TABLE.spec("valid_rows"), (labels,), dict(ignore_index=ignore_index, scale=scale,
                                                                      losses=losses))
    return stats[2], stats[0]


def mean_scale(labels: Optional[torch.Tensor], n: int, ignore_index: int, device, scale: float = 1.0) -> torch.Tensor:
    """scale / count as an fp32 device scalar, count the rows not ignored (all n without labels), at least 1."""
    if labels is None:
        return torch.full((), scale / max(n, 1), device=device)
    return valid_count(labels, ignore_index, scale)[1]


def flat(t: torch.Tensor, last: Optional[int] = None) -> torch.Tensor:
    """t as [-1] (or [-1, last]): itself when it already is one (no view made per call)."""
    if t.dim() == (1 if last is None else 2):
        return t
    return t.reshape(-1) if last is None else t.reshape(-1, last)


def wanted_grads(need_grads, count: int) -> list[bool]:
    """need_grads as `count` flags (missing ones are False)."""
    return ([bool(w) for w in need_grads] + [False] * count)[:count]
