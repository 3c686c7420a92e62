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

Which one serves a call: two reads, unless target_reads=1 forces the single read. The fix-up is exact algebra but
not exact arithmetic: g1 is stored in the logits' dtype before Q is known, so the fixed-up gradient carries |Q| times
g1's rounding, |Q| 2^-24 (fp32) or |Q| 2^-9 (bf16 logits) of max |softmax - q|, where two reads round
|Q softmax - q| once. Measured in the interpreter against float64 (6 x 200, relative norm error of the gradient,
single read / two reads / torch fp32; bf16 gradients there truncate, twice round-to-nearest's error): Q = 10,
fp32 logits 2.0e-7 / 9.6e-8 / 6.2e-8, bf16 logits 3.9e-2 / 4.0e-3 / 2.3e-3; log-probabilities passed as
probabilities (Q ~ -170) 1.1e-5 / 9.8e-8 / 7.8e-8 (fp32), 1.6 / 3.5e-3 / 1.6e-3 (bf16); log-targets randn * 3
1.2e-3 / 4.8e-8 / 7.6e-8 (fp32), 23 / 3.9e-3 / 1.7e-3 (bf16). Targets that
sum to 1 (a teacher's softmax in fp32) skip the fix-up and lose nothing: the knob is for them. Passes after the
first walk the row in the other direction (block_start), so they begin on the blocks still in L2.

Targets (benchmarks/kl_semantics.md): 0 log 0 = 0, also for eps = 0 and a log-target of -inf; a negative
probability (log-probabilities passed with log_target=False, for one) makes its row's loss NaN, as torch's
kl_div, and leaves the gradient softmax * Q - q, as torch's; +inf gives a +inf loss and a non-finite gradient
row; log-targets may be unnormalized: q = e^target to about an ulp (precise_exp), and the softmax is taken with
the row max subtracted before the base-2 scaling (shifted_softmax_step).
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
    block_start, launch_row_kernel, load_block, load_scale, log2, row_launch, scale_args, valid_row, zero_row,
)

NORMALIZED_TOL = tl.constexpr(2.0**-18)
LN2_HI = tl.constexpr(0.693145751953125)  # ln 2 to 12 significant bits: n * LN2_HI is exact for |n| < 2^12
LN2_LO = tl.constexpr(1.4286068203094173e-06)  # ln 2 - LN2_HI


@triton.jit
def precise_exp(x):
    """e^x to about an ulp, for log-targets (Cody-Waite): 2^n * 2^(r log2 e) with n = round(x log2 e), |n| <= 127,
    and r = x - n ln 2.

    exp2(x * log2 e) rounds the product x log2 e, an absolute error of up to 2^-24 |x log2 e| in the exponent:
    relative error 4e-7 in e^x at |x| = 12, 7 ulps, which the gradient softmax * sum q - q and the loss inherit
    (torch's exp is within an ulp). Here x - n LN2_HI is exact, |r| <= ln 2 / 2, so r and r log2 e are rounded
    at 2^-25 and exp2 of a power of 2 is exact: within about an ulp overall. -inf gives 0, +inf inf, NaN NaN.
    """
    y = tl.minimum(tl.maximum(x * LOG2E, -126.0), 127.0)
    n = (y + tl.where(y < 0.0, -0.5, 0.5)).to(tl.int32).to(tl.float32)  # nearest (the cast truncates)
    r = (x - n * LN2_HI) - n * LN2_LO
    return tl.exp2(n) * tl.exp2(r * LOG2E)


@triton.jit
def shifted_softmax_step(m, s, to_log2):
    """online_softmax_step on raw logits s (masked lanes -inf), the running max m of s subtracted before the
    base-2 scaling: returns m_new, alpha = exp2((m - m_new) to_log2), exp2((s - m_new) to_log2).

    Scaling first (s2 = s * to_log2, then s2 - m2) rounds s2 at the size of the logit: an error of 2^-24 |s2| in
    the exponent of every softmax entry, 10 ulps at |s2| = 13, which the gradient's softmax * sum q amplifies
    against q when sum q >> 1; (s - m) is exact near the max, so the entries that matter are rounded once.
    """
    m_new = tl.maximum(m, tl.max(s, 0))
    return m_new, tl.exp2((m - m_new) * to_log2), tl.exp2((s - m_new) * to_log2)


@triton.jit
def _target_probs(target, mask, LOG_TARGET: tl.constexpr):
    """q for this block (0 on masked lanes) from probabilities, or from log-probabilities when LOG_TARGET."""
    if LOG_TARGET:
        q = precise_exp(target)
    else:
        q = target
    return tl.where(mask, q, 0.0)


@triton.jit
def _kl_terms(s2, target, mask, lse2, eps, LOG_TARGET: tl.constexpr):
    """(q, log2 softmax, this block's loss terms q (log q - log softmax)) of one block; 0 log 0 = 0.

    A negative probability gives a NaN term (torch's kl_div: NaN), so its row's loss is NaN; q itself, and with
    it the gradient, stays as given."""
    q = _target_probs(target, mask, LOG_TARGET)
    if LOG_TARGET:
        log_q = tl.where(q != 0.0, target, 0.0)  # target may be -inf
    else:
        log_q = log2(tl.maximum(q, eps)) * LN2  # log(max(q, eps)); eps >= FLT_MIN
        log_q = tl.where(q < 0.0, float("nan"), log_q)
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
        s, mask = load_block(S, start, cols, V, "evict_last")
        m, alpha, e = shifted_softmax_step(m, tl.where(mask, s, -float("inf")), to_log2)
        d = d * alpha + e
        if not TARGET_ONCE:
            target, _ = load_block(Q, start, cols, V, "evict_last")
            q_sum += _target_probs(target, mask, LOG_TARGET)
    lse2 = tl.log2(tl.sum(d, 0))  # of (s - m) / T in base 2
    # The gradient pass takes the row's Q from pass 1, or Q = 1 (fixed up below) when the target is read once.
    total_q = 1.0 if TARGET_ONCE else tl.sum(q_sum, 0)

    scale = load_scale(SCALE, scale_stride, row, HAS_SCALE) * grad_mult
    loss = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, (V + BLOCK - 1) // BLOCK, num_stages=NUM_STAGES):
        start = block_start(i, V, BLOCK, True)
        s, mask = load_block(S, start, cols, V, "evict_first")
        target, _ = load_block(Q, start, cols, V, "evict_first")
        q, ls2, terms = _kl_terms((s - m) * to_log2, target, mask, lse2, eps, LOG_TARGET)
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
    """RowLaunch plus the variant: the target read once (1, with the fix-up pass) or twice (2, also None)."""

    target_reads: Optional[int] = None


def reads_target_once(target, knobs: KLLaunch, log_target: bool = False) -> bool:
    """Whether the single-target-read variant serves this call (module docstring): only when forced (target_reads=1),
    for targets known to sum to 1 per row."""
    if knobs.target_reads is None:
        return False
    if knobs.target_reads not in (1, 2):
        raise ValueError(f"target_reads: 1 or 2 (or None: 2), got {knobs.target_reads!r}")
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
    launch_row_kernel(
        _kl_kernel, C,
        (student_logits, student_logits.stride(0), target, target.stride(0),
         loss if labels is None else labels, 0 if labels is None else labels.stride(0), loss, scale, scale_stride),
        (ignore_index, LOG2E.value / temperature, 1.0 / temperature, max(float(eps), FLT_MIN.value)),
        V=V, LOG_TARGET=bool(log_target), HAS_LABELS=labels is not None, HAS_SCALE=has_scale,
        TARGET_ONCE=reads_target_once(target, knobs, bool(log_target)),
        **row_launch(V, student_logits, target, knobs=knobs),
    )
    return loss
