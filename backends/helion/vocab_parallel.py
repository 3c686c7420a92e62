"""Vocab-parallel CE, JSD and KL as Helion kernels: per-row statistics of this rank's vocabulary slice, and the
gradient pass that takes the statistics combined over ranks (the driver all-reduces them in between).

Each kernel streams a row once, one row a program as the row kernels of ce.py / jsd.py / kl_div.py, base-2 math
inside (exp2 / log2), natural-log statistics outside:
    ce:     stats (lse, max z, z_target if this slice owns the target, sum w z, sum w)  ->  grad
    jsd:    stats (lse of s and of t)  ->  sums (loss, S) under the global lse  ->  grad
    kl_div: stats (lse, sum q, sum q log q, sum q s)  ->  grad
Statistics passes load with an evict-last hint (the gradient pass reads the row again). Ignored rows are never
read: zero statistics, zero gradient, whatever global statistics the driver passes for them.
"""

from typing import Optional

import torch
import helion.language as hl

from liger_dispatch import register_backend

from .._vp_rows import row_stats
from ._support import (
    CAPABILITY, FLT_MIN, KEEP, LN2, LOG2E, PRIORITY, STREAM, Kernel, bucket, exp2, flat_rows, load_f32, log2,
    needs_int64, online_softmax_step, row_config, row_scale, valid_rows,
)
from .ce import coefficients, grad_block, smoothing_sums, target_weight
from .kl_div import precise_exp, target_log

FORWARD_KL, REVERSE_KL, MIXTURE = 0, 1, 2


def beta_case(beta: float) -> int:
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXTURE


# ---------------------------------------------------------------- cross-entropy


def _ce_stats(
    logits: torch.Tensor,  # [C, Vl] this rank's logits, only read
    logits_flat: torch.Tensor,  # logits' storage as 1-D, for the target gather
    row_stride: int,
    target: torch.Tensor,  # [C] global class indices
    weights: Optional[torch.Tensor],  # [vocab_size] the whole vocabulary's class weights, or None
    stats: torch.Tensor,  # [C, 5] out: lse, max z, z_target (0 unless owned here), sum w z, sum w
    vocab_start: int,
    ignore_index: int,
    softcap: Optional[float],
) -> None:
    C, V = logits.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        y = target[tile_c].to(torch.int32)
        valid = y != ignore_index
        local = y - vocab_start
        owned = valid & (local >= 0) & (local < V)
        z_y = hl.load(logits_flat, [tile_c.index * row_stride + torch.where(owned, local, 0)]).to(torch.float32)
        if softcap is not None:
            z_y = softcap * torch.tanh(z_y / softcap)
        row_mask = valid[:, None]  # ignored rows are never read
        m = hl.full([tile_c], float("-inf"), dtype=torch.float32)
        d = hl.zeros([tile_c, block_v], dtype=torch.float32)
        z_sum = hl.zeros([tile_c, block_v], dtype=torch.float32)
        w_sum = hl.zeros([tile_c, block_v], dtype=torch.float32)
        z_max = hl.full([tile_c, block_v], float("-inf"), dtype=torch.float32)
        for tile_v in hl.tile(V, block_size=block_v):
            z = load_f32(logits, tile_c, tile_v, row_mask, KEEP)
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            in_row = tile_v.index[None, :] < V
            m, alpha, e = online_softmax_step(m, z * LOG2E, in_row)
            d = d * alpha + e
            z_sum, w_sum = smoothing_sums(z_sum, w_sum, z, weights, tile_v, vocab_start, V)  # lanes past V: z = 0
            z_max = torch.maximum(z_max, torch.where(in_row, z, float("-inf")))
        lse = (m + log2(torch.sum(d, dim=1))) * LN2
        stats[tile_c, 0] = torch.where(valid, lse, 0.0)
        stats[tile_c, 1] = torch.where(valid, torch.amax(z_max, dim=1), 0.0)
        stats[tile_c, 2] = torch.where(owned, z_y, 0.0)
        stats[tile_c, 3] = torch.where(valid, torch.sum(z_sum, dim=1), 0.0)
        if weights is not None:
            stats[tile_c, 4] = torch.where(valid, torch.sum(w_sum, dim=1), 0.0)
        else:
            stats[tile_c, 4] = torch.where(valid, hl.full([tile_c], 1.0, dtype=torch.float32) * V, 0.0)


def _ce_grad(
    logits: torch.Tensor,  # [C, Vl] this rank's logits, overwritten by the gradient
    target: torch.Tensor,  # [C] global class indices
    stats: torch.Tensor,  # [C, 5] global statistics (ce_vp_stats' columns)
    scale: torch.Tensor,  # [C] grad_scale per row
    weights: Optional[torch.Tensor],  # [vocab_size] the whole vocabulary's class weights, or None
    vocab_start: int,
    ignore_index: int,
    smoothing: float,
    inv_vocab: float,  # 1 / global V
    lse_square_scale: float,
    softcap: Optional[float],
) -> None:
    C, V = logits.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        y = target[tile_c].to(torch.int32)
        valid = y != ignore_index
        row_mask = valid[:, None]
        row_lse = stats[tile_c, 0].to(torch.float32)
        weight_mean = hl.full([tile_c], 1.0, dtype=torch.float32)
        if weights is not None:
            weight_mean = stats[tile_c, 4].to(torch.float32) * inv_vocab
        g_scale = torch.where(valid, scale[tile_c], 0.0)
        p_coef, uniform, on_target = coefficients(g_scale, smoothing, inv_vocab, target_weight(weights, tile_c, y, valid),
                                                  weight_mean, row_lse, lse_square_scale)
        for tile_v in hl.tile(V, block_size=block_v):
            x = load_f32(logits, tile_c, tile_v, row_mask, STREAM)
            g = grad_block(x, y - vocab_start, row_lse * LOG2E, p_coef, uniform, on_target, weights, tile_v,
                           vocab_start, V, softcap)
            logits[tile_c, tile_v] = torch.where(row_mask, g, 0.0).to(logits.dtype)


# ---------------------------------------------------------------- JSD


def _jsd_stats(
    student: torch.Tensor,  # [C, Vl] student logits, only read
    teacher: torch.Tensor,  # [C, Vl] teacher logits, only read
    labels: Optional[torch.Tensor],  # [C] or None
    stats: torch.Tensor,  # [C, 2] out: lse of student / T, lse of teacher / T
    ignore_index: int,
    to_log2: float,  # log2(e) / T
) -> None:
    C, V = student.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        valid = valid_rows(labels, tile_c, ignore_index)
        row_mask = valid[:, None]
        m_s = hl.full([tile_c], float("-inf"), dtype=torch.float32)
        m_t = hl.full([tile_c], float("-inf"), dtype=torch.float32)
        d_s = hl.zeros([tile_c, block_v], dtype=torch.float32)
        d_t = hl.zeros([tile_c, block_v], dtype=torch.float32)
        for tile_v in hl.tile(V, block_size=block_v):
            s2 = load_f32(student, tile_c, tile_v, row_mask, KEEP) * to_log2
            t2 = load_f32(teacher, tile_c, tile_v, row_mask, KEEP) * to_log2
            in_row = tile_v.index[None, :] < V
            m_s, alpha_s, e_s = online_softmax_step(m_s, s2, in_row)
            m_t, alpha_t, e_t = online_softmax_step(m_t, t2, in_row)
            d_s = d_s * alpha_s + e_s
            d_t = d_t * alpha_t + e_t
        stats[tile_c, 0] = torch.where(valid, (m_s + log2(torch.sum(d_s, dim=1))) * LN2, 0.0)
        stats[tile_c, 1] = torch.where(valid, (m_t + log2(torch.sum(d_t, dim=1))) * LN2, 0.0)


def _jsd_lse2(lse, tile_c):
    """The global base-2 normalizers (student, teacher) of the rows of tile_c, from the natural-log lse [C, 2]."""
    return lse[tile_c, 0].to(torch.float32) * LOG2E, lse[tile_c, 1].to(torch.float32) * LOG2E


def _jsd_log_probs2(student, teacher, tile_c, tile_v, row_mask, to_log2, lse_s2, lse_t2, policy):
    """(log2 q, log2 p) over tile_v of the rows of tile_c, under the global base-2 normalizers lse_s2, lse_t2."""
    ls2 = load_f32(student, tile_c, tile_v, row_mask, policy) * to_log2 - lse_s2.unsqueeze(1)
    lt2 = load_f32(teacher, tile_c, tile_v, row_mask, policy) * to_log2 - lse_t2.unsqueeze(1)
    return ls2, lt2


def _jsd_terms(ls2, lt2, beta, case):
    """Per element: (row-loss term / ln 2, q, p, diff), diff = log2(q / m) for a mixture, else log2(q / p)."""
    q = exp2(ls2)
    p = exp2(lt2)
    if case == MIXTURE:
        lm2 = log2(torch.clamp_min(beta * p + (1.0 - beta) * q, FLT_MIN))
        diff = ls2 - lm2
        return beta * p * (lt2 - lm2) + (1.0 - beta) * q * diff, q, p, diff
    diff = ls2 - lt2
    return (q * diff if case == REVERSE_KL else -p * diff), q, p, diff


def _jsd_accumulate(row_loss, cross, term, q, diff, in_row, case):
    """Adds a tile's loss terms to the per-lane sums, and for a mixture its q log2(q / m) terms to cross (a Python
    `if` on the constexpr case: Helion's device `if` here fails to compile)."""
    row_loss = row_loss + torch.where(in_row, term, 0.0)
    if case == MIXTURE:
        cross = cross + torch.where(in_row, q * diff, 0.0)
    return row_loss, cross


def _jsd_sums(
    student: torch.Tensor,  # [C, Vl] student logits, only read
    teacher: torch.Tensor,  # [C, Vl] teacher logits, only read
    labels: Optional[torch.Tensor],  # [C] or None
    lse: torch.Tensor,  # [C, 2] global lse of student / T and teacher / T
    sums: torch.Tensor,  # [C, 2] out: this slice's part of the row loss and of S
    ignore_index: int,
    to_log2: float,
    beta: float,
    case: hl.constexpr,
) -> None:
    """Base 2 inside (ls2 = log2 q, ...); both sums leave multiplied by ln 2."""
    C, V = student.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        valid = valid_rows(labels, tile_c, ignore_index)
        row_mask = valid[:, None]
        lse_s2, lse_t2 = _jsd_lse2(lse, tile_c)
        row_loss = hl.zeros([tile_c, block_v], dtype=torch.float32)
        cross = hl.zeros([tile_c, block_v], dtype=torch.float32)
        for tile_v in hl.tile(V, block_size=block_v):
            ls2, lt2 = _jsd_log_probs2(student, teacher, tile_c, tile_v, row_mask, to_log2, lse_s2, lse_t2, KEEP)
            term, q, _, diff = _jsd_terms(ls2, lt2, beta, case)
            row_loss, cross = _jsd_accumulate(row_loss, cross, term, q, diff, tile_v.index[None, :] < V, case)
        loss = torch.where(valid, torch.sum(row_loss, dim=1) * LN2, 0.0)
        sums[tile_c, 0] = loss
        if case == FORWARD_KL:
            sums[tile_c, 1] = hl.zeros([tile_c], dtype=torch.float32)
        elif case == REVERSE_KL:
            sums[tile_c, 1] = loss
        else:
            sums[tile_c, 1] = torch.where(valid, torch.sum(cross, dim=1) * LN2, 0.0)


def _jsd_grad(
    student: torch.Tensor,  # [C, Vl] student logits, overwritten by the gradient
    teacher: torch.Tensor,  # [C, Vl] teacher logits, only read
    labels: Optional[torch.Tensor],  # [C] or None
    lse: torch.Tensor,  # [C, 2] global lse of student / T and teacher / T
    sums: torch.Tensor,  # [C, 2] global (loss, S)
    scale: torch.Tensor,  # [C] grad_scale per row
    ignore_index: int,
    to_log2: float,
    grad_mult: float,  # 1 / T
    beta: float,
    case: hl.constexpr,
) -> None:
    """beta = 0: q - p; beta = 1: ln2 q (diff - S2); else (1 - beta) ln2 q (diff - S2), with S2 = S / ln 2."""
    C, V = student.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        valid = valid_rows(labels, tile_c, ignore_index)
        row_mask = valid[:, None]
        lse_s2, lse_t2 = _jsd_lse2(lse, tile_c)
        cross2 = sums[tile_c, 1].to(torch.float32) * LOG2E
        g_scale = torch.where(valid, scale[tile_c], 0.0) * grad_mult
        if case == REVERSE_KL:
            g_scale = g_scale * LN2
        elif case == MIXTURE:
            g_scale = g_scale * ((1.0 - beta) * LN2)
        for tile_v in hl.tile(V, block_size=block_v):
            ls2, lt2 = _jsd_log_probs2(student, teacher, tile_c, tile_v, row_mask, to_log2, lse_s2, lse_t2, STREAM)
            _, q, p, diff = _jsd_terms(ls2, lt2, beta, case)
            if case == FORWARD_KL:
                g = q - p
            else:
                g = q * (diff - cross2[:, None])
            student[tile_c, tile_v] = torch.where(row_mask, g_scale[:, None] * g, 0.0).to(student.dtype)


# ---------------------------------------------------------------- KL divergence


def _kl_div_stats(
    student: torch.Tensor,  # [C, Vl] student logits, only read
    target: torch.Tensor,  # [C, Vl] q, or log q with log_target; only read
    labels: Optional[torch.Tensor],  # [C] or None
    stats: torch.Tensor,  # [C, 4] out: lse of s = student / T, sum q, sum q log q, sum q s
    ignore_index: int,
    inv_temp: float,
    eps: float,
    log_target: hl.constexpr,
) -> None:
    C, V = student.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        valid = valid_rows(labels, tile_c, ignore_index)
        row_mask = valid[:, None]
        m = hl.full([tile_c], float("-inf"), dtype=torch.float32)
        d = hl.zeros([tile_c, block_v], dtype=torch.float32)
        q_sum = hl.zeros([tile_c, block_v], dtype=torch.float32)
        q_log_q = hl.zeros([tile_c, block_v], dtype=torch.float32)
        q_s = hl.zeros([tile_c, block_v], dtype=torch.float32)
        for tile_v in hl.tile(V, block_size=block_v):
            s = load_f32(student, tile_c, tile_v, row_mask, KEEP) * inv_temp
            tq = load_f32(target, tile_c, tile_v, row_mask, KEEP)
            in_row = tile_v.index[None, :] < V
            m, alpha, e = online_softmax_step(m, s * LOG2E, in_row)
            d = d * alpha + e
            q, log_q = target_log(tq, eps, log_target)
            q = torch.where(in_row, q, 0.0)  # lanes past V loaded 0: log q = 0 with log_target
            q_sum = q_sum + q
            # 0 log 0 = 0, also where log q is -inf (eps = 0, or a log-target of -inf); NaN for q < 0
            q_log_q = q_log_q + torch.where(q != 0.0, q * log_q, 0.0)
            q_s = q_s + q * s
        stats[tile_c, 0] = torch.where(valid, (m + log2(torch.sum(d, dim=1))) * LN2, 0.0)
        stats[tile_c, 1] = torch.where(valid, torch.sum(q_sum, dim=1), 0.0)
        stats[tile_c, 2] = torch.where(valid, torch.sum(q_log_q, dim=1), 0.0)
        stats[tile_c, 3] = torch.where(valid, torch.sum(q_s, dim=1), 0.0)


def _kl_div_grad(
    student: torch.Tensor,  # [C, Vl] student logits, overwritten by the gradient
    target: torch.Tensor,  # [C, Vl] q, or log q with log_target; only read
    labels: Optional[torch.Tensor],  # [C] or None
    lse: torch.Tensor,  # [C] global lse of student / T
    target_sum: torch.Tensor,  # [C] global sum q
    scale: torch.Tensor,  # [C] grad_scale per row
    ignore_index: int,
    inv_temp: float,
    log_target: hl.constexpr,
) -> None:
    C, V = student.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        valid = valid_rows(labels, tile_c, ignore_index)
        row_mask = valid[:, None]
        lse2 = lse[tile_c].to(torch.float32) * LOG2E
        total_q = target_sum[tile_c].to(torch.float32)
        g_scale = torch.where(valid, scale[tile_c], 0.0) * inv_temp
        for tile_v in hl.tile(V, block_size=block_v):
            s2 = load_f32(student, tile_c, tile_v, row_mask, STREAM) * (inv_temp * LOG2E)
            tq = load_f32(target, tile_c, tile_v, row_mask, STREAM)
            q = precise_exp(tq) if log_target else tq
            g = g_scale[:, None] * (exp2(s2 - lse2[:, None]) * total_q[:, None] - q)
            student[tile_c, tile_v] = torch.where(row_mask, g, 0.0).to(student.dtype)


# ---------------------------------------------------------------- kernels and their configs


def one_input_config(v_bucket: int) -> dict:
    """CE: one row a program, blocks of up to 4096 columns, as ce.py."""
    return row_config(v_bucket, 4096)


def two_input_config(v_bucket: int) -> dict:
    """JSD and KL: one row a program, blocks of up to 2048 columns (two inputs a thread), as jsd.py / kl_div.py."""
    return row_config(v_bucket, 2048)


CE_STATS = Kernel(_ce_stats, "ce_vp_stats", one_input_config)
CE_GRAD = Kernel(_ce_grad, "ce_vp_grad", one_input_config)
JSD_STATS = Kernel(_jsd_stats, "jsd_vp_stats", two_input_config)
JSD_SUMS = Kernel(_jsd_sums, "jsd_vp_sums", two_input_config)
JSD_GRAD = Kernel(_jsd_grad, "jsd_vp_grad", two_input_config)
KL_DIV_STATS = Kernel(_kl_div_stats, "kl_div_vp_stats", two_input_config)
KL_DIV_GRAD = Kernel(_kl_div_grad, "kl_div_vp_grad", two_input_config)
KERNELS = (CE_STATS, CE_GRAD, JSD_STATS, JSD_SUMS, JSD_GRAD, KL_DIV_STATS, KL_DIV_GRAD)


def _launch(like: torch.Tensor, *tensors: torch.Tensor) -> dict:
    return dict(like=like, shape_key=bucket(like.shape[1]), int64=needs_int64(like, *tensors))


# ---------------------------------------------------------------- registered ops


@register_backend("ce_vp_stats", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def ce_vp_stats(logits, target, *, vocab_start=0, ignore_index=-100, softcap=None, ce_weight=None):
    """[C, 5] fp32 per row of this slice: (lse, max z, z_target where this slice owns the target else 0, sum w z,
    sum w)."""
    stats, C, V = row_stats(logits, 5, target, ignore_index, lse_columns=(0, 1))
    if C and V:
        CE_STATS(logits, flat_rows(logits), logits.stride(0), target, ce_weight, stats, int(vocab_start),
                 int(ignore_index), None if softcap is None else float(softcap), **_launch(logits))
    return stats


@register_backend("ce_vp_grad", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def ce_vp_grad(logits, target, stats, *, vocab_start=0, vocab_size=0, grad_scale=None, ignore_index=-100,
               label_smoothing=0.0, softcap=None, lse_square_scale=0.0, ce_weight=None):
    """Overwrites this slice's logits with grad_scale * dloss/dlogits under the global statistics [C, 5]."""
    C, V = logits.shape
    if C == 0 or V == 0:
        return
    CE_GRAD(logits, target, stats, row_scale(grad_scale, C, logits), ce_weight, int(vocab_start), int(ignore_index),
            float(label_smoothing), 1.0 / (vocab_size or V), float(lse_square_scale),
            None if softcap is None else float(softcap), **_launch(logits))


@register_backend("jsd_vp_stats", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def jsd_vp_stats(student_logits, teacher_logits, labels=None, *, ignore_index=-100, temperature=1.0):
    """[C, 2] fp32 per row of this slice: lse of student / T and of teacher / T."""
    stats, C, V = row_stats(student_logits, 2, labels, ignore_index, lse_columns=(0, 1))
    if C and V:
        JSD_STATS(student_logits, teacher_logits, labels, stats, int(ignore_index), LOG2E / temperature,
                  **_launch(student_logits, teacher_logits))
    return stats


@register_backend("jsd_vp_sums", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def jsd_vp_sums(student_logits, teacher_logits, lse, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0):
    """[C, 2] fp32 per row: this slice's part of the row loss and of S, under the global lse [C, 2]."""
    sums, C, V = row_stats(student_logits, 2)
    if not (C and V):
        return sums
    JSD_SUMS(student_logits, teacher_logits, labels, lse, sums, int(ignore_index), LOG2E / temperature, float(beta),
             beta_case(float(beta)), **_launch(student_logits, teacher_logits))
    return sums


@register_backend("jsd_vp_grad", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def jsd_vp_grad(student_logits, teacher_logits, lse, sums, labels=None, *, beta=0.5, ignore_index=-100,
                temperature=1.0, grad_scale=None):
    """Overwrites this slice's student logits with grad_scale * dloss/dlogits under the global lse and sums."""
    C, V = student_logits.shape
    if C == 0 or V == 0:
        return
    JSD_GRAD(student_logits, teacher_logits, labels, lse, sums, row_scale(grad_scale, C, student_logits),
             int(ignore_index), LOG2E / temperature, 1.0 / temperature, float(beta), beta_case(float(beta)),
             **_launch(student_logits, teacher_logits))


@register_backend("kl_div_vp_stats", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def kl_div_vp_stats(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                    log_target=False):
    """[C, 4] fp32 per row of this slice: (lse of s = student / T, sum q, sum q log q, sum q s)."""
    stats, C, V = row_stats(student_logits, 4, labels, ignore_index, lse_columns=(0,))
    if C and V:
        KL_DIV_STATS(student_logits, target, labels, stats, int(ignore_index), 1.0 / temperature,
                     max(float(eps), FLT_MIN), bool(log_target), **_launch(student_logits, target))
    return stats


@register_backend("kl_div_vp_grad", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def kl_div_vp_grad(student_logits, target, lse, target_sum, labels=None, *, ignore_index=-100, temperature=1.0,
                   log_target=False, grad_scale=None):
    """Overwrites this slice's student logits with grad_scale / T * (softmax_j * target_sum - q_j)."""
    C, V = student_logits.shape
    if C == 0 or V == 0:
        return
    KL_DIV_GRAD(student_logits, target, labels, lse, target_sum, row_scale(grad_scale, C, student_logits),
                int(ignore_index), 1.0 / temperature, bool(log_target), **_launch(student_logits, target))
