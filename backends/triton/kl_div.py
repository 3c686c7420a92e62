"""KL(target || softmax(student / T)) against explicit target probabilities: loss and student gradient in 2 passes.

Pass 1 builds the student's softmax statistics and sum_k q_k; pass 2 accumulates the loss element by element
(no cancellation between large terms) and writes dL/ds_j = softmax_j * sum_k q_k - q_j over the student logits.
"""

import triton
import triton.language as tl

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._rows import row_losses
from ._support import (
    CAPABILITY, FLT_MIN, LOG2E, LN2, PRIORITY, RowLaunch,
    load_block, load_scale, log2, online_softmax_step, row_launch, scale_args, valid_row, zero_row,
)


@triton.jit
def _target_probs(target, mask, LOG_TARGET: tl.constexpr):
    """q for this block (0 on masked lanes) from probabilities, or from log-probabilities when LOG_TARGET."""
    if LOG_TARGET:
        q = tl.exp2(target * LOG2E)
    else:
        q = target
    return tl.where(mask, q, 0.0)


@triton.jit
def _target_log(target, q, eps, LOG_TARGET: tl.constexpr):
    """log q for this block, finite where q = 0 (so that q log q = 0 there): the target itself when LOG_TARGET (it may
    be -inf), else log(max(q, eps)) (eps >= FLT_MIN)."""
    if LOG_TARGET:
        log_q = tl.where(q != 0.0, target, 0.0)
    else:
        log_q = log2(tl.maximum(q, eps)) * LN2
    return log_q


@triton.jit
def kl_row_stats(S, Q, to_log2, eps, LOG_TARGET: tl.constexpr, LOSS_SUMS: tl.constexpr, V: tl.constexpr,
                 BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Pass 1 over the student row S and the target row Q: (lse2 of s2 = S * to_log2, sum_k q_k, and with LOSS_SUMS
    sum_k q_k log q_k and sum_k q_k s2_k, else 0 and 0)."""
    cols = tl.arange(0, BLOCK)
    m = -float("inf")
    d = tl.zeros([BLOCK], tl.float32)
    q_sum = tl.zeros([BLOCK], tl.float32)
    q_log_q = tl.zeros([BLOCK], tl.float32)
    q_s2 = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        s2, mask = load_block(S, start, cols, V, "evict_last")
        target, _ = load_block(Q, start, cols, V, "evict_last")
        s2 *= to_log2
        m, alpha, e = online_softmax_step(m, tl.where(mask, s2, -float("inf")))
        d = d * alpha + e
        q = _target_probs(target, mask, LOG_TARGET)
        q_sum += q
        if LOSS_SUMS:
            q_log_q += q * _target_log(target, q, eps, LOG_TARGET)
            q_s2 += q * s2
    return m + tl.log2(tl.sum(d, 0)), tl.sum(q_sum, 0), tl.sum(q_log_q, 0), tl.sum(q_s2, 0)


@triton.jit
def kl_row_grad(S, Q, lse2, total_q, scale, to_log2, eps, LOG_TARGET: tl.constexpr, LOSS: tl.constexpr,
                V: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Pass 2: the student row S overwritten with scale * (softmax_j * total_q - q_j), softmax from lse2; returns the
    row's loss sum_k q_k (log q_k - log softmax_k) element by element when LOSS (no cancellation), else 0."""
    cols = tl.arange(0, BLOCK)
    loss = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        s2, mask = load_block(S, start, cols, V, "evict_first")
        target, _ = load_block(Q, start, cols, V, "evict_first")
        s2 *= to_log2
        q = _target_probs(target, mask, LOG_TARGET)
        ls2 = s2 - lse2
        if LOSS:
            loss += q * (_target_log(target, q, eps, LOG_TARGET) - ls2 * LN2)  # 0 log 0 = 0
        g = scale * (tl.exp2(ls2) * total_q - q)
        tl.store(S + start + cols, g.to(S.dtype.element_ty), mask=mask)
    return tl.sum(loss, 0)


@triton.jit
def _kl_kernel(
    S, s_stride,  # [C, V] student logits, overwritten by the gradient
    Q, q_stride,  # [C, V] target probabilities (log-probabilities when LOG_TARGET), only read
    LABELS, label_stride,  # [C] int labels, a row whose label is ignore_index is skipped; unread without HAS_LABELS
    LOSS,  # [C] fp32 per-row loss, written
    SCALE, scale_stride,  # [C] grad_scale (stride 0: one value for every row); unread without HAS_SCALE
    ignore_index, to_log2, grad_mult, eps,
    V: tl.constexpr, LOG_TARGET: tl.constexpr, HAS_LABELS: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    S += row * s_stride
    Q += row * q_stride
    if not valid_row(LABELS, label_stride, row, ignore_index, HAS_LABELS):
        zero_row(S, LOSS, row, V, BLOCK)
        return

    lse2, total_q, _, _ = kl_row_stats(S, Q, to_log2, eps, LOG_TARGET, False, V, BLOCK, NUM_STAGES)
    scale = load_scale(SCALE, scale_stride, row, HAS_SCALE) * grad_mult
    loss = kl_row_grad(S, Q, lse2, total_q, scale, to_log2, eps, LOG_TARGET, True, V, BLOCK, NUM_STAGES)
    tl.store(LOSS + row, loss)


LAUNCH = LaunchKnobs("triton kl_div_loss_and_grad", RowLaunch())


@register_backend("kl_div_loss_and_grad", backend="triton", priority=PRIORITY, capability=CAPABILITY)
def kl_div_loss_and_grad(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                         log_target=False, grad_scale=None):
    """Per-row KL(target || softmax(student / T)) [C] fp32 (unscaled); student_logits are overwritten with
    grad_scale * dloss/dlogits. The target is only read."""
    loss, C, V = row_losses(student_logits)
    if C == 0:
        return loss
    scale, scale_stride, has_scale = scale_args(grad_scale, loss)
    _kl_kernel[(C,)](
        student_logits, student_logits.stride(0), target, target.stride(0),
        loss if labels is None else labels, 0 if labels is None else labels.stride(0),
        loss, scale, scale_stride,
        ignore_index, LOG2E.value / temperature, 1.0 / temperature, max(float(eps), FLT_MIN.value),
        V=V, LOG_TARGET=bool(log_target), HAS_LABELS=labels is not None, HAS_SCALE=has_scale,
        **row_launch(V, student_logits, target, knobs=LAUNCH.current),
    )
    return loss
