"""KL(target || softmax(student / T)) against explicit target probabilities: loss and student gradient per row.

dL/ds_j = (softmax_j * Q - q_j) / T with Q = sum_k q_k, so the gradient pass needs the whole row's Q. Two variants:

- target read twice (TARGET_ONCE = False): pass 1 reads student and target for the softmax statistics and Q; pass 2
  reads both again, accumulates the loss element by element (no cancellation between large terms) and writes the
  gradient over the student logits.
- target read once (TARGET_ONCE = True): pass 1 reads only the student; pass 2 reads student and target, adds up
  the loss and Q, and writes the gradient for Q = 1. A row whose Q turns out further than NORMALIZED_TOL from 1 gets
  a fix-up pass that reads the target again: g = Q g1 + scale (Q - 1) q_j turns g1 = scale (softmax_j - q_j) into
  scale (Q softmax_j - q_j). No streaming kernel can do without it: the gradient of every column needs Q, Q needs
  every column of the target, and the student logits are gone once the first gradient block is written.
  Within NORMALIZED_TOL the gradient is off by scale |Q - 1| softmax_j <= 2^-18 scale softmax_j, the order of the
  error every kernel here already makes in softmax_j = exp2(s2_j - lse2) (that difference is rounded to fp32: half
  an ulp of a log2-logit of 16-32 is 2^-20), and far below a 16-bit gradient's rounding.

Which one serves a call: fp32 targets (teacher probabilities or log-probabilities computed in fp32 sum to 1 within
~1e-6) take the single read; 16-bit targets are rounded far from Q = 1 (1e-5 to 1e-3), so the fix-up would run on
every row and cost more than the second read it saves: they keep two reads. Passes after the first walk the row
in the other direction (block_start), so they begin on the blocks still in L2.
"""

from dataclasses import dataclass
from typing import Optional

import triton
import triton.language as tl

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._rows import row_losses
from ._support import (
    CAPABILITY, FLT_MIN, LOG2E, LN2, PRIORITY, RowLaunch,
    block_start, load_block, load_scale, log2, online_softmax_step, row_launch, scale_args, valid_row, zero_row,
)

NORMALIZED_TOL = tl.constexpr(2.0**-18)


@triton.jit
def _target_probs(target, mask, LOG_TARGET: tl.constexpr):
    """q for this block (0 on masked lanes) from probabilities, or from log-probabilities when LOG_TARGET."""
    if LOG_TARGET:
        q = tl.exp2(target * LOG2E)
    else:
        q = target
    return tl.where(mask, q, 0.0)


@triton.jit
def _kl_terms(s2, target, mask, lse2, eps, LOG_TARGET: tl.constexpr):
    """(q, log2 softmax, this block's loss terms q (log q - log softmax)) of one block; 0 log 0 = 0."""
    q = _target_probs(target, mask, LOG_TARGET)
    if LOG_TARGET:
        log_q = tl.where(q != 0.0, target, 0.0)  # target may be -inf
    else:
        log_q = log2(tl.maximum(q, eps)) * LN2  # log(max(q, eps)); eps >= FLT_MIN
    ls2 = s2 - lse2
    return q, ls2, q * (log_q - ls2 * LN2)  # log_q is finite where q = 0


@triton.jit
def _kl_kernel(
    S, s_stride,  # [C, V] student logits, overwritten by the gradient
    Q, q_stride,  # [C, V] target probabilities (log-probabilities when LOG_TARGET), only read
    LABELS, label_stride,  # [C] int labels, a row whose label is ignore_index is skipped; unread without HAS_LABELS
    LOSS,  # [C] fp32 per-row loss, written
    SCALE, scale_stride,  # [C] grad_scale (stride 0: one value for every row); unread without HAS_SCALE
    ignore_index, to_log2, grad_mult, eps,
    V: tl.constexpr, LOG_TARGET: tl.constexpr, HAS_LABELS: tl.constexpr, HAS_SCALE: tl.constexpr,
    TARGET_ONCE: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    S += row * s_stride
    Q += row * q_stride
    if not valid_row(LABELS, label_stride, row, ignore_index, HAS_LABELS):
        zero_row(S, LOSS, row, V, BLOCK)
        return

    cols = tl.arange(0, BLOCK)
    m = -float("inf")
    d = tl.zeros([BLOCK], tl.float32)
    q_sum = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        s2, mask = load_block(S, start, cols, V, "evict_last")
        s2 *= to_log2
        m, alpha, e = online_softmax_step(m, tl.where(mask, s2, -float("inf")))
        d = d * alpha + e
        if not TARGET_ONCE:
            target, _ = load_block(Q, start, cols, V, "evict_last")
            q_sum += _target_probs(target, mask, LOG_TARGET)
    lse2 = m + tl.log2(tl.sum(d, 0))
    # The gradient pass takes the row's Q from pass 1, or Q = 1 (fixed up below) when the target is read once.
    total_q = 1.0 if TARGET_ONCE else tl.sum(q_sum, 0)

    scale = load_scale(SCALE, scale_stride, row, HAS_SCALE) * grad_mult
    loss = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, (V + BLOCK - 1) // BLOCK, num_stages=NUM_STAGES):
        start = block_start(i, V, BLOCK, True)
        s2, mask = load_block(S, start, cols, V, "evict_first")
        target, _ = load_block(Q, start, cols, V, "evict_first")
        q, ls2, terms = _kl_terms(s2 * to_log2, target, mask, lse2, eps, LOG_TARGET)
        loss += terms
        if TARGET_ONCE:
            q_sum += q
        g = scale * (tl.exp2(ls2) * total_q - q)
        tl.store(S + start + cols, g.to(S.dtype.element_ty), mask=mask)
    tl.store(LOSS + row, tl.sum(loss, 0))

    if TARGET_ONCE:
        total_q = tl.sum(q_sum, 0)
        if tl.abs(total_q - 1.0) > NORMALIZED_TOL:
            for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
                g, mask = load_block(S, start, cols, V, "evict_first")
                target, _ = load_block(Q, start, cols, V, "evict_first")
                g = total_q * g + (scale * (total_q - 1.0)) * _target_probs(target, mask, LOG_TARGET)
                tl.store(S + start + cols, g.to(S.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class KLLaunch(RowLaunch):
    """RowLaunch plus the variant: the target read once (1, with the fix-up pass) or twice (2); None: by its dtype."""

    target_reads: Optional[int] = None


def reads_target_once(target, knobs: KLLaunch) -> bool:
    """Whether the single-target-read variant serves this target (module docstring): fp32 targets, unless forced."""
    if knobs.target_reads is None:
        return target.element_size() == 4
    if knobs.target_reads not in (1, 2):
        raise ValueError(f"target_reads: 1 or 2 (or None: by the target's dtype), got {knobs.target_reads!r}")
    return knobs.target_reads == 1


LAUNCH = LaunchKnobs("triton kl_div_loss_and_grad", KLLaunch())


@register_backend("kl_div_loss_and_grad", backend="triton", priority=PRIORITY, capability=CAPABILITY)
def kl_div_loss_and_grad(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                         log_target=False, grad_scale=None):
    """Per-row KL(target || softmax(student / T)) [C] fp32 (unscaled); student_logits are overwritten with
    grad_scale * dloss/dlogits. The target is only read."""
    loss, C, V = row_losses(student_logits)
    if C == 0:
        return loss
    scale, scale_stride, has_scale = scale_args(grad_scale, loss)
    knobs = LAUNCH.current
    _kl_kernel[(C,)](
        student_logits, student_logits.stride(0), target, target.stride(0),
        loss if labels is None else labels, 0 if labels is None else labels.stride(0),
        loss, scale, scale_stride,
        ignore_index, LOG2E.value / temperature, 1.0 / temperature, max(float(eps), FLT_MIN.value),
        V=V, LOG_TARGET=bool(log_target), HAS_LABELS=labels is not None, HAS_SCALE=has_scale,
        TARGET_ONCE=reads_target_once(target, knobs),
        **row_launch(V, student_logits, target, knobs=knobs),
    )
    return loss
