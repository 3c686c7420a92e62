"""Generalized Jensen-Shannon divergence between student and teacher logits, loss and student gradient in one kernel.

beta = 0 (KL(p||q)) and beta = 1 (KL(q||p)) need 2 passes over each row: their loss is an expectation that the
online softmax can rescale as the max moves, and the gradient's cross-column term is the loss itself (beta = 1)
or absent (beta = 0). Any other beta needs log m_j = log(beta p_j + (1 - beta) q_j), which is only known once
both normalizers are, so it takes 3: statistics, then loss and sum_k q_k (log q_k - log m_k), then the gradient.

Two passes at such a beta are out of reach for a kernel that streams rows: every column's gradient needs that
cross-column sum, which depends on the final normalizers through the log of the mixture (it cannot be rescaled as
the running max and sums move, as the beta = 0 / 1 expectations can), and once a gradient block is written the
student logits behind it are gone, so neither a provisional gradient nor a later correction can be made exact
(the correction is proportional to q_j). What the third pass costs can still shrink: passes alternate direction
(block_start), so the second and third start on the blocks the pass before read last, the ones still in L2.
"""

import triton
import triton.language as tl

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._rows import row_losses
from ._support import (
    CAPABILITY, FLT_MIN, LOG2E, LN2, PRIORITY, RowLaunch,
    block_start, launch_row_kernel, load_pair, load_scale, log2, online_softmax_step, row_launch, scale_args,
    valid_row, zero_row,
)

FORWARD_KL, REVERSE_KL, MIXTURE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def jsd_row_stats(S, T, cols, to_log2, MODE: tl.constexpr, V: tl.constexpr, BLOCK: tl.constexpr,
                  NUM_STAGES: tl.constexpr):
    """Pass 1, forward, over the student row S and the teacher row T in blocks of cols = arange(BLOCK), base 2
    (s2 = S * to_log2, t2 likewise): (lse_s, lse_t, sum_s, sum_t, acc), sum_* = exp2(lse_* - running max), and acc
    the per-lane sum_j exp2(t2_j - m_t) (t2_j - s2_j) for FORWARD_KL (s and t swapped for REVERSE_KL; 0 for MIXTURE)."""
    m_s = -float("inf")
    m_t = -float("inf")
    d_s = tl.zeros([BLOCK], tl.float32)
    d_t = tl.zeros([BLOCK], tl.float32)
    # FORWARD_KL: sum_j exp2(t2_j - m_t) (t2_j - s2_j); REVERSE_KL: the same with s and t swapped.
    acc = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        s2, t2, mask = load_pair(S, T, start, cols, V, to_log2, "evict_last")
        m_s, alpha_s, e_s = online_softmax_step(m_s, tl.where(mask, s2, -float("inf")))
        m_t, alpha_t, e_t = online_softmax_step(m_t, tl.where(mask, t2, -float("inf")))
        d_s = d_s * alpha_s + e_s
        d_t = d_t * alpha_t + e_t
        # masked lanes: e = 0 times (0 - 0)
        if MODE == FORWARD_KL:
            acc = acc * alpha_t + e_t * (t2 - s2)
        elif MODE == REVERSE_KL:
            acc = acc * alpha_s + e_s * (s2 - t2)
    sum_s = tl.sum(d_s, 0)
    sum_t = tl.sum(d_t, 0)
    return m_s + tl.log2(sum_s), m_t + tl.log2(sum_t), sum_s, sum_t, acc


@triton.jit
def jsd_row_sums(S, T, cols, lse_s, lse_t, beta, to_log2, MODE: tl.constexpr, V: tl.constexpr, BLOCK: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    """A backward pass: per-lane sums (loss, cross) of a row in base 2 from its base-2 log-sum-exps, element by
    element: FORWARD_KL p_k (lt2_k - ls2_k) and 0; REVERSE_KL q_k (ls2_k - lt2_k) and 0; MIXTURE
    beta p_k (lt2_k - lm2_k) + (1 - beta) q_k (ls2_k - lm2_k) and q_k (ls2_k - lm2_k)."""
    loss = tl.zeros([BLOCK], tl.float32)
    cross = tl.zeros([BLOCK], tl.float32)
    for i in tl.range(0, (V + BLOCK - 1) // BLOCK, num_stages=NUM_STAGES):
        start = block_start(i, V, BLOCK, True)
        s2, t2, mask = load_pair(S, T, start, cols, V, to_log2, "evict_last")
        ls2 = s2 - lse_s
        lt2 = t2 - lse_t
        if MODE == FORWARD_KL:
            loss += tl.where(mask, tl.exp2(lt2) * (lt2 - ls2), 0.0)
        elif MODE == REVERSE_KL:
            loss += tl.where(mask, tl.exp2(ls2) * (ls2 - lt2), 0.0)
        else:
            q = tl.exp2(ls2)
            p = tl.exp2(lt2)
            # m == 0 only where p and q both underflow: then both terms are 0 * finite
            lm2 = log2(tl.maximum(beta * p + (1.0 - beta) * q, FLT_MIN))
            q_term = tl.where(mask, q * (ls2 - lm2), 0.0)
            loss += beta * tl.where(mask, p * (lt2 - lm2), 0.0) + (1.0 - beta) * q_term
            cross += q_term
    return loss, cross


@triton.jit
def _jsd_grad_block(S, T, start, cols, lse_s, lse_t, cross2, shift, scale, g_mult, beta, to_log2, MODE: tl.constexpr,
                    V: tl.constexpr):
    """One block of jsd_row_grad."""
    s2, t2, mask = load_pair(S, T, start, cols, V, to_log2, "evict_first")
    if MODE == FORWARD_KL:
        g = scale * (tl.exp2(s2 - lse_s) - tl.exp2(t2 - lse_t))
    elif MODE == REVERSE_KL:
        g = (scale * LN2) * tl.exp2(s2 - lse_s) * (s2 - t2 - shift)
    else:
        ls2 = s2 - lse_s
        q = tl.exp2(ls2)
        lm2 = log2(tl.maximum(beta * tl.exp2(t2 - lse_t) + (1.0 - beta) * q, FLT_MIN))
        g = g_mult * q * (ls2 - lm2 - cross2)
    tl.store(S + start + cols, g.to(S.dtype.element_ty), mask=mask)


@triton.jit
def jsd_row_grad(S, T, cols, lse_s, lse_t, cross2, scale, beta, to_log2, MODE: tl.constexpr, V: tl.constexpr,
                 BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr, BACKWARD: tl.constexpr):
    """The student row S overwritten with scale * dL/ds, walked backward or forward, from the row's base-2
    statistics; cross2 is KL2(q||p) for REVERSE_KL, sum_k q_k (ls2_k - lm2_k) for MIXTURE (unused for FORWARD_KL):
    FORWARD_KL q - p; REVERSE_KL q ln2 (ls2 - lt2 - cross2); MIXTURE (1 - beta) q ln2 (ls2 - lm2 - cross2)."""
    shift = lse_s - lse_t + cross2
    g_mult = scale * (1.0 - beta) * LN2
    if BACKWARD:
        for i in tl.range(0, (V + BLOCK - 1) // BLOCK, num_stages=NUM_STAGES):
            _jsd_grad_block(S, T, block_start(i, V, BLOCK, True), cols, lse_s, lse_t, cross2, shift, scale, g_mult,
                            beta, to_log2, MODE, V)
    else:
        for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
            _jsd_grad_block(S, T, start, cols, lse_s, lse_t, cross2, shift, scale, g_mult, beta, to_log2, MODE, V)


@triton.jit
def _jsd_kernel(
    S, s_stride,  # [C, V] student logits, overwritten by the gradient
    T, t_stride,  # [C, V] teacher logits, only read
    LABELS, label_stride,  # [C] int labels, a row whose label is ignore_index is skipped; unread without HAS_LABELS
    LOSS,  # [C] fp32 per-row loss, written
    SCALE, scale_stride,  # [C] grad_scale (stride 0: one value for every row); unread without HAS_SCALE
    ignore_index, beta, to_log2, grad_mult,
    V: tl.constexpr, MODE: tl.constexpr, HAS_LABELS: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    S += row * s_stride
    T += row * t_stride
    if not valid_row(LABELS, label_stride, row, ignore_index, HAS_LABELS):
        zero_row(S, LOSS, row, V, BLOCK)
        return

    # All logs below are base 2: s2 = student * log2(e) / T, t2 likewise, ls2 = log2 q, lt2 = log2 p.
    # Pass 1 walks the row forward, the next pass backward, a third forward again (block_start).
    cols = tl.arange(0, BLOCK)
    lse_s, lse_t, sum_s, sum_t, acc = jsd_row_stats(S, T, cols, to_log2, MODE, V, BLOCK, NUM_STAGES)

    scale = load_scale(SCALE, scale_stride, row, HAS_SCALE) * grad_mult
    if MODE == FORWARD_KL:
        # KL(p||q) = E_p[t2 - s2] - lse_t + lse_s; dL/ds = q - p
        tl.store(LOSS + row, (tl.sum(acc, 0) / sum_t - lse_t + lse_s) * LN2)
        jsd_row_grad(S, T, cols, lse_s, lse_t, 0.0, scale, beta, to_log2, MODE, V, BLOCK, NUM_STAGES, True)
    elif MODE == REVERSE_KL:
        # KL(q||p) = E_q[s2 - t2] - lse_s + lse_t = sum_k q_k (ls2_k - lt2_k); dL/ds_j = q_j ln2 (ls2_j - lt2_j - KL2)
        kl2 = tl.sum(acc, 0) / sum_s - lse_s + lse_t
        tl.store(LOSS + row, kl2 * LN2)
        jsd_row_grad(S, T, cols, lse_s, lse_t, kl2, scale, beta, to_log2, MODE, V, BLOCK, NUM_STAGES, True)
    else:
        # loss = beta KL(p||m) + (1 - beta) KL(q||m);
        # dL/ds_j = (1 - beta) q_j ln2 ((ls2_j - lm2_j) - sum_k q_k (ls2_k - lm2_k))
        loss, cross = jsd_row_sums(S, T, cols, lse_s, lse_t, beta, to_log2, MODE, V, BLOCK, NUM_STAGES)
        tl.store(LOSS + row, tl.sum(loss, 0) * LN2)
        jsd_row_grad(S, T, cols, lse_s, lse_t, tl.sum(cross, 0), scale, beta, to_log2, MODE, V, BLOCK, NUM_STAGES,
                     False)


LAUNCH = LaunchKnobs("triton jsd_loss_and_grad", RowLaunch())


@register_backend("jsd_loss_and_grad", backend="triton", priority=PRIORITY, capability=CAPABILITY)
def jsd_loss_and_grad(student_logits, teacher_logits, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0,
                      grad_scale=None):
    """Per-row generalized JSD [C] fp32 (unscaled); student_logits are overwritten with grad_scale * dloss/dlogits.
    The teacher is only read."""
    loss, C, V = row_losses(student_logits)
    if C == 0:
        return loss
    scale, scale_stride, has_scale = scale_args(grad_scale, loss)
    mode = (FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXTURE).value
    launch_row_kernel(
        _jsd_kernel, C,
        (student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0),
         loss if labels is None else labels, 0 if labels is None else labels.stride(0), loss, scale, scale_stride),
        (ignore_index, float(beta), LOG2E.value / temperature, 1.0 / temperature),
        V=V, MODE=mode, HAS_LABELS=labels is not None, HAS_SCALE=has_scale,
        **row_launch(V, student_logits, teacher_logits, knobs=LAUNCH.current),
    )
    return loss
