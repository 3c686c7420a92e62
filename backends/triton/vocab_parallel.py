"""Vocab-parallel kernel-level ops (declared by the op families in registry/) in Triton, one program per row over this rank's slice
of the vocabulary, built from the row passes of the single-vocabulary kernels (ce.py, jsd.py, kl_div.py).

Statistics leave a kernel in natural log (the contract) and the global ones come back in; inside, as in those
kernels, everything is base 2. A statistics row is written as k scalars at OUT + row * k ([C, k] fp32,
contiguous); the global statistics the gradient passes read are strided views of the driver's combined [C, k].
"""

import torch
import triton
import triton.language as tl

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from ._support import (
    CAPABILITY, FLT_MIN, LOG2E, LN2, PRIORITY, RowLaunch,
    load_block, load_scale, online_softmax_step, row_launch, scale_args, tanh, valid_row, zero_cols,
)
from .ce import ce_coefficients, ce_row_grad, ce_row_stats, load_weight
from .jsd import FORWARD_KL, MIXTURE, REVERSE_KL, jsd_row_grad, jsd_row_stats, jsd_row_sums
from .kl_div import _kl_terms


# one set of row-kernel knobs for the module's seven kernels (tests force small blocks with LAUNCH.using)
LAUNCH = LaunchKnobs("triton vocab-parallel ops", RowLaunch())


def _register(op):
    return register_backend(op, backend="triton", priority=PRIORITY, capability=CAPABILITY)


def _launch(n_cols, *tensors):
    """row_launch for rows of n_cols (an empty slice launches its statistics rows with a block of 1)."""
    return row_launch(max(n_cols, 1), *tensors, knobs=LAUNCH.current)


@triton.jit
def _zero_stats(OUT, K: tl.constexpr):
    """An ignored row's statistics: K zeros at OUT."""
    cols = tl.arange(0, 8)
    tl.store(OUT + cols, tl.zeros([8], tl.float32), mask=cols < K)


@triton.jit
def _ce_stats_kernel(
    X, x_stride,  # [C, V] logits of this slice
    Y, y_stride,  # [C] global class indices
    W,  # [vocab_size] the whole vocabulary's class weights; unread without HAS_WEIGHT
    OUT,  # [C, 5] fp32: lse, max z, z_target (0 when the target is not in this slice), sum w z, sum w
    vocab_start, ignore_index, softcap, inv_softcap,
    V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * x_stride
    OUT += row * 5
    y = tl.load(Y + row * y_stride)
    if y == ignore_index:
        _zero_stats(OUT, 5)
        return
    lse2, z_sum, w_sum, z_max = ce_row_stats(X, W + vocab_start, tl.arange(0, BLOCK), softcap, inv_softcap, V, HAS_SOFTCAP, True,
                                             HAS_WEIGHT, True, BLOCK, NUM_STAGES)
    column = y - vocab_start
    z_y = tl.load(X + column, mask=(column >= 0) & (column < V), other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z_y = softcap * tanh(z_y * inv_softcap)
    tl.store(OUT, lse2 * LN2)
    tl.store(OUT + 1, tl.max(z_max, 0))
    tl.store(OUT + 2, z_y)
    tl.store(OUT + 3, tl.sum(z_sum, 0))
    if HAS_WEIGHT:
        tl.store(OUT + 4, tl.sum(w_sum, 0))
    else:
        tl.store(OUT + 4, V * 1.0)


@triton.jit
def _ce_grad_kernel(
    X, x_stride,  # [C, V] logits of this slice, overwritten by their gradient
    Y, y_stride,  # [C] global class indices
    STATS, stats_stride,  # [C, 5] global statistics (ce_vp_stats' columns)
    SCALE, scale_stride,  # [C] or 0-d grad_scale
    W,  # [vocab_size] the whole vocabulary's class weights; unread without HAS_WEIGHT
    vocab_start, ignore_index, smoothing, inv_vocab, lse_square_scale, softcap, inv_softcap,
    V: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * x_stride
    y = tl.load(Y + row * y_stride)
    if y == ignore_index:
        zero_cols(X, V, BLOCK)
        return
    STATS += row * stats_stride
    lse = tl.load(STATS)
    weight_mean = 1.0
    if HAS_WEIGHT:
        weight_mean = tl.load(STATS + 4) * inv_vocab
    scale = load_scale(SCALE, scale_stride, row, HAS_SCALE)
    p_coef, uniform, on_target = ce_coefficients(scale, smoothing, inv_vocab, load_weight(W, y, HAS_WEIGHT),
                                                 weight_mean, lse, lse_square_scale)
    ce_row_grad(X, W + vocab_start, tl.arange(0, BLOCK), (y - vocab_start).to(tl.int32), lse * LOG2E, p_coef, uniform,
                on_target, softcap, inv_softcap, V, HAS_SOFTCAP, HAS_WEIGHT, BLOCK, NUM_STAGES)


@_register("ce_vp_stats")
def ce_vp_stats(logits, target, *, vocab_start=0, ignore_index=-100, softcap=None, ce_weight=None):
    C, V = logits.shape
    out = torch.empty(C, 5, dtype=torch.float32, device=logits.device)
    if C:
        cap = float(softcap or 1.0)
        _ce_stats_kernel[(C,)](
            logits, logits.stride(0), target, target.stride(0), out if ce_weight is None else ce_weight, out, vocab_start, ignore_index, cap,
            1.0 / cap, V=V, HAS_SOFTCAP=softcap is not None, HAS_WEIGHT=ce_weight is not None, **_launch(V, logits),
        )
    return out


@_register("ce_vp_grad")
def ce_vp_grad(logits, target, stats, *, vocab_start=0, vocab_size=0, grad_scale=None, ignore_index=-100,
               label_smoothing=0.0, softcap=None, lse_square_scale=0.0, ce_weight=None):
    C, V = logits.shape
    if C == 0 or V == 0:
        return
    scale, scale_stride, has_scale = scale_args(grad_scale, stats)
    cap = float(softcap or 1.0)
    _ce_grad_kernel[(C,)](
        logits, logits.stride(0), target, target.stride(0), stats, stats.stride(0), scale, scale_stride,
        stats if ce_weight is None else ce_weight, vocab_start, ignore_index, float(label_smoothing),
        1.0 / (vocab_size or V), float(lse_square_scale), cap, 1.0 / cap, V=V, HAS_SCALE=has_scale,
        HAS_SOFTCAP=softcap is not None, HAS_WEIGHT=ce_weight is not None, **_launch(V, logits),
    )


@triton.jit
def _jsd_stats_kernel(
    S, s_stride, T, t_stride,  # [C, V] student and teacher logits of this slice
    LABELS, label_stride,  # [C] or unused
    OUT,  # [C, 2] fp32: lse of student / T, lse of teacher / T
    ignore_index, to_log2,
    V: tl.constexpr, HAS_LABELS: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    OUT += row * 2
    if not valid_row(LABELS, label_stride, row, ignore_index, HAS_LABELS):
        _zero_stats(OUT, 2)
        return
    lse_s, lse_t, _, _, _ = jsd_row_stats(S + row * s_stride, T + row * t_stride, tl.arange(0, BLOCK), to_log2,
                                          MIXTURE, V, BLOCK, NUM_STAGES)
    tl.store(OUT, lse_s * LN2)
    tl.store(OUT + 1, lse_t * LN2)


@triton.jit
def _global_lse2(LSE, lse_stride, lse_col_stride, row):
    """The row's global (student, teacher) lse of a [C, 2] tensor, in base 2."""
    LSE += row * lse_stride
    return tl.load(LSE) * LOG2E, tl.load(LSE + lse_col_stride) * LOG2E


@triton.jit
def _jsd_sums_kernel(
    S, s_stride, T, t_stride,  # [C, V] student and teacher logits of this slice
    LABELS, label_stride,  # [C] or unused
    LSE, lse_stride, lse_col_stride,  # [C, 2] global lse of student / T and teacher / T
    OUT,  # [C, 2] fp32: this slice's part of the row loss and of the gradient's cross term
    ignore_index, beta, to_log2,
    V: tl.constexpr, MODE: tl.constexpr, HAS_LABELS: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    OUT += row * 2
    if not valid_row(LABELS, label_stride, row, ignore_index, HAS_LABELS):
        _zero_stats(OUT, 2)
        return
    lse_s, lse_t = _global_lse2(LSE, lse_stride, lse_col_stride, row)
    loss, cross = jsd_row_sums(S + row * s_stride, T + row * t_stride, tl.arange(0, BLOCK), lse_s, lse_t, beta,
                               to_log2, MODE, V, BLOCK, NUM_STAGES)
    loss2 = tl.sum(loss, 0)
    if MODE == REVERSE_KL:
        cross2 = loss2
    else:
        cross2 = tl.sum(cross, 0)
    tl.store(OUT, loss2 * LN2)
    tl.store(OUT + 1, cross2 * LN2)


@triton.jit
def _jsd_grad_kernel(
    S, s_stride,  # [C, V] student logits of this slice, overwritten by their gradient
    T, t_stride,  # [C, V] teacher logits of this slice
    LABELS, label_stride,  # [C] or unused
    LSE, lse_stride, lse_col_stride,  # [C, 2] global lse
    SUMS, sums_stride, sums_col_stride,  # [C, 2] global (loss, cross term)
    SCALE, scale_stride,  # [C] or 0-d grad_scale
    ignore_index, beta, to_log2, grad_mult,
    V: tl.constexpr, MODE: tl.constexpr, HAS_LABELS: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    S += row * s_stride
    if not valid_row(LABELS, label_stride, row, ignore_index, HAS_LABELS):
        zero_cols(S, V, BLOCK)
        return
    lse_s, lse_t = _global_lse2(LSE, lse_stride, lse_col_stride, row)
    cross2 = tl.load(SUMS + row * sums_stride + sums_col_stride) * LOG2E
    scale = load_scale(SCALE, scale_stride, row, HAS_SCALE) * grad_mult
    jsd_row_grad(S, T + row * t_stride, tl.arange(0, BLOCK), lse_s, lse_t, cross2, scale, beta, to_log2, MODE, V,
                 BLOCK, NUM_STAGES, False)


def _jsd_mode(beta):
    return (FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXTURE).value


def _labels_args(labels, dummy):
    """labels (or a never-read pointer) and its stride, and whether there are labels."""
    return (dummy, 0, False) if labels is None else (labels, labels.stride(0), True)


@_register("jsd_vp_stats")
def jsd_vp_stats(student_logits, teacher_logits, labels=None, *, ignore_index=-100, temperature=1.0):
    C, V = student_logits.shape
    out = torch.empty(C, 2, dtype=torch.float32, device=student_logits.device)
    if C:
        lab, lab_stride, has_labels = _labels_args(labels, out)
        _jsd_stats_kernel[(C,)](
            student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), lab, lab_stride, out,
            ignore_index, LOG2E.value / temperature,
            V=V, HAS_LABELS=has_labels, **_launch(V, student_logits, teacher_logits),
        )
    return out


@_register("jsd_vp_sums")
def jsd_vp_sums(student_logits, teacher_logits, lse, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0):
    C, V = student_logits.shape
    out = torch.empty(C, 2, dtype=torch.float32, device=student_logits.device)
    if C:
        lab, lab_stride, has_labels = _labels_args(labels, out)
        _jsd_sums_kernel[(C,)](
            student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), lab, lab_stride,
            lse, lse.stride(0), lse.stride(1), out, ignore_index, float(beta), LOG2E.value / temperature,
            V=V, MODE=_jsd_mode(beta), HAS_LABELS=has_labels,
            **_launch(V, student_logits, teacher_logits),
        )
    return out


@_register("jsd_vp_grad")
def jsd_vp_grad(student_logits, teacher_logits, lse, sums, labels=None, *, beta=0.5, ignore_index=-100,
                temperature=1.0, grad_scale=None):
    C, V = student_logits.shape
    if C == 0 or V == 0:
        return
    lab, lab_stride, has_labels = _labels_args(labels, lse)
    scale, scale_stride, has_scale = scale_args(grad_scale, lse)
    _jsd_grad_kernel[(C,)](
        student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0), lab, lab_stride,
        lse, lse.stride(0), lse.stride(1), sums, sums.stride(0), sums.stride(1), scale, scale_stride,
        ignore_index, float(beta), LOG2E.value / temperature, 1.0 / temperature,
        V=V, MODE=_jsd_mode(beta), HAS_LABELS=has_labels, HAS_SCALE=has_scale,
        **_launch(V, student_logits, teacher_logits),
    )


@triton.jit
def _kl_stats_kernel(
    S, s_stride,  # [C, V] student logits of this slice
    Q, q_stride,  # [C, V] target probabilities (or their logs) of this slice
    LABELS, label_stride,  # [C] or unused
    OUT,  # [C, 4] fp32: lse of student / T, sum q, sum q log q, sum q student / T
    ignore_index, to_log2, eps,
    V: tl.constexpr, LOG_TARGET: tl.constexpr, HAS_LABELS: tl.constexpr, BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    OUT += row * 4
    if not valid_row(LABELS, label_stride, row, ignore_index, HAS_LABELS):
        _zero_stats(OUT, 4)
        return
    S += row * s_stride
    Q += row * q_stride
    cols = tl.arange(0, BLOCK)
    m = -float("inf")
    d = tl.zeros([BLOCK], tl.float32)
    q_sum = tl.zeros([BLOCK], tl.float32)
    terms = tl.zeros([BLOCK], tl.float32)
    q_s2 = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        s2, mask = load_block(S, start, cols, V, "evict_first")
        target, _ = load_block(Q, start, cols, V, "evict_first")
        s2 *= to_log2
        m, alpha, e = online_softmax_step(m, tl.where(mask, s2, -float("inf")))
        d = d * alpha + e
        # the loss terms at lse2 = 0 are q (log q - s2 ln2): q log q is those plus q s2 ln2
        q, _, block_terms = _kl_terms(s2, target, mask, 0.0, eps, LOG_TARGET)
        q_sum += q
        terms += block_terms
        q_s2 += q * s2
    q_s = tl.sum(q_s2, 0) * LN2
    tl.store(OUT, (m + tl.log2(tl.sum(d, 0))) * LN2)
    tl.store(OUT + 1, tl.sum(q_sum, 0))
    tl.store(OUT + 2, tl.sum(terms, 0) + q_s)
    tl.store(OUT + 3, q_s)


@triton.jit
def _kl_grad_kernel(
    S, s_stride,  # [C, V] student logits of this slice, overwritten by their gradient
    Q, q_stride,  # [C, V] target probabilities (or their logs) of this slice
    LABELS, label_stride,  # [C] or unused
    LSE, lse_stride,  # [C] global lse of student / T
    TOTAL, total_stride,  # [C] global sum q
    SCALE, scale_stride,  # [C] or 0-d grad_scale
    ignore_index, to_log2, grad_mult,
    V: tl.constexpr, LOG_TARGET: tl.constexpr, HAS_LABELS: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    S += row * s_stride
    if not valid_row(LABELS, label_stride, row, ignore_index, HAS_LABELS):
        zero_cols(S, V, BLOCK)
        return
    Q += row * q_stride
    lse2 = tl.load(LSE + row * lse_stride) * LOG2E
    total_q = tl.load(TOTAL + row * total_stride)
    scale = load_scale(SCALE, scale_stride, row, HAS_SCALE) * grad_mult
    cols = tl.arange(0, BLOCK)
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        s2, mask = load_block(S, start, cols, V, "evict_first")
        target, _ = load_block(Q, start, cols, V, "evict_first")
        q, ls2, _ = _kl_terms(s2 * to_log2, target, mask, lse2, 1.0, LOG_TARGET)  # eps only enters the loss terms
        g = scale * (tl.exp2(ls2) * total_q - q)
        tl.store(S + start + cols, g.to(S.dtype.element_ty), mask=mask)


@_register("kl_div_vp_stats")
def kl_div_vp_stats(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                    log_target=False):
    C, V = student_logits.shape
    out = torch.empty(C, 4, dtype=torch.float32, device=student_logits.device)
    if C:
        lab, lab_stride, has_labels = _labels_args(labels, out)
        _kl_stats_kernel[(C,)](
            student_logits, student_logits.stride(0), target, target.stride(0), lab, lab_stride, out,
            ignore_index, LOG2E.value / temperature, max(float(eps), FLT_MIN.value),
            V=V, LOG_TARGET=bool(log_target), HAS_LABELS=has_labels,
            **_launch(V, student_logits, target),
        )
    return out


@_register("kl_div_vp_grad")
def kl_div_vp_grad(student_logits, target, lse, target_sum, labels=None, *, ignore_index=-100, temperature=1.0,
                   log_target=False, grad_scale=None):
    C, V = student_logits.shape
    if C == 0 or V == 0:
        return
    lab, lab_stride, has_labels = _labels_args(labels, lse)
    scale, scale_stride, has_scale = scale_args(grad_scale, lse)
    _kl_grad_kernel[(C,)](
        student_logits, student_logits.stride(0), target, target.stride(0), lab, lab_stride,
        lse, lse.stride(0), target_sum, target_sum.stride(0), scale, scale_stride,
        ignore_index, LOG2E.value / temperature, 1.0 / temperature,
        V=V, LOG_TARGET=bool(log_target), HAS_LABELS=has_labels, HAS_SCALE=has_scale,
        **_launch(V, student_logits, target),
    )
