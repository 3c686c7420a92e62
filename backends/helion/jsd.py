"""Generalized JSD between student and teacher logits: loss and student gradient in a Helion kernel, one for
beta = 0 or 1 and one for the mixtures.

All logs are base 2 in the kernels: s2 = student * log2(e) / T, t2 likewise; ls2 = log2 q, lt2 = log2 p.
beta = 0 (KL(p||q)) and beta = 1 (KL(q||p)) take 2 passes over each row: their loss is an expectation the online
softmax rescales as the max moves, and the gradient's cross-column term is the loss itself (beta = 1) or absent
(beta = 0). Any other beta needs log m_j = log(beta p_j + (1 - beta) q_j), known only once both normalizers are:
3 passes (statistics; loss and sum_k q_k (ls_k - lm_k); gradient). The teacher is only read.
"""

from typing import Optional

import torch
import helion.language as hl

from liger_dispatch import register_backend

from .._rows import row_losses
from ._support import (
    CAPABILITY, FLT_MIN, KEEP, LN2, LOG2E, PRIORITY, STREAM, Kernel, bucket, exp2, load_f32, log2, needs_int64,
    online_softmax_step, row_config, row_scale, valid_rows,
)


def _kl_pair(
    student: torch.Tensor, teacher: torch.Tensor, labels: Optional[torch.Tensor], scale: torch.Tensor,
    loss: torch.Tensor, ignore_index: int, to_log2: float, grad_mult: float, reverse: hl.constexpr,
) -> None:
    """beta = 0 (not reverse): KL(p||q) = E_p[t2 - s2] - lse_t + lse_s (times ln 2); dL/ds = q - p.
    beta = 1 (reverse): KL(q||p) = E_q[s2 - t2] - lse_s + lse_t = KL2; dL/ds_j = q_j ln2 (ls2_j - lt2_j - KL2)."""
    C, V = student.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        valid = valid_rows(labels, tile_c, ignore_index)
        row_mask = valid[:, None]  # ignored rows are never read
        m_s = hl.full([tile_c], float("-inf"), dtype=torch.float32)
        m_t = hl.full([tile_c], float("-inf"), dtype=torch.float32)
        d_s = hl.zeros([tile_c, block_v], dtype=torch.float32)
        d_t = hl.zeros([tile_c, block_v], dtype=torch.float32)
        e_diff = hl.zeros([tile_c, block_v], dtype=torch.float32)  # E_p[t2 - s2], or E_q[s2 - t2] when reverse
        for tile_v in hl.tile(V, block_size=block_v):
            s2 = load_f32(student, tile_c, tile_v, row_mask, KEEP) * to_log2
            t2 = load_f32(teacher, tile_c, tile_v, row_mask, KEEP) * to_log2
            in_row = tile_v.index[None, :] < V
            m_s, alpha_s, e_s = online_softmax_step(m_s, s2, in_row)
            m_t, alpha_t, e_t = online_softmax_step(m_t, t2, in_row)
            d_s = d_s * alpha_s + e_s
            d_t = d_t * alpha_t + e_t
            if reverse:
                e_diff = e_diff * alpha_s + e_s * (s2 - t2)
            else:
                e_diff = e_diff * alpha_t + e_t * (t2 - s2)
        sum_s = torch.sum(d_s, dim=1)
        lse_s = m_s + log2(sum_s)
        sum_t = torch.sum(d_t, dim=1)
        lse_t = m_t + log2(sum_t)
        if reverse:
            kl2 = torch.sum(e_diff, dim=1) / sum_s - lse_s + lse_t
        else:
            kl2 = torch.sum(e_diff, dim=1) / sum_t - lse_t + lse_s
        loss[tile_c] = torch.where(valid, kl2 * LN2, 0.0)
        if reverse:
            g_scale = torch.where(valid, scale[tile_c], 0.0) * (grad_mult * LN2)
            shift = lse_s - lse_t + kl2
        else:
            g_scale = torch.where(valid, scale[tile_c], 0.0) * grad_mult
        for tile_v in hl.tile(V, block_size=block_v):
            s2 = load_f32(student, tile_c, tile_v, row_mask, STREAM) * to_log2
            t2 = load_f32(teacher, tile_c, tile_v, row_mask, STREAM) * to_log2
            if reverse:
                g = g_scale[:, None] * exp2(s2 - lse_s[:, None]) * (s2 - t2 - shift[:, None])
            else:
                g = g_scale[:, None] * (exp2(s2 - lse_s[:, None]) - exp2(t2 - lse_t[:, None]))
            student[tile_c, tile_v] = g.to(student.dtype)


def _mixture(
    student: torch.Tensor, teacher: torch.Tensor, labels: Optional[torch.Tensor], scale: torch.Tensor,
    loss: torch.Tensor, ignore_index: int, to_log2: float, grad_mult: float, beta: float,
) -> None:
    """0 < beta < 1: loss = beta KL(p||m) + (1-beta) KL(q||m); dL/ds_j = (1-beta) q_j ln2 ((ls2_j - lm2_j) - X2)
    with X2 = sum_k q_k (ls2_k - lm2_k)."""
    C, V = student.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        valid = valid_rows(labels, tile_c, ignore_index)
        row_mask = valid[:, None]  # ignored rows are never read
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
        lse_s = m_s + log2(torch.sum(d_s, dim=1))
        lse_t = m_t + log2(torch.sum(d_t, dim=1))

        row_loss = hl.zeros([tile_c, block_v], dtype=torch.float32)
        cross = hl.zeros([tile_c, block_v], dtype=torch.float32)
        for tile_v in hl.tile(V, block_size=block_v):
            ls2 = load_f32(student, tile_c, tile_v, row_mask, KEEP) * to_log2 - lse_s[:, None]
            lt2 = load_f32(teacher, tile_c, tile_v, row_mask, KEEP) * to_log2 - lse_t[:, None]
            q = exp2(ls2)
            p = exp2(lt2)
            # m < FLT_MIN only where p and q both underflow: the clamp keeps log2 m finite
            lm2 = log2(torch.clamp_min(beta * p + (1.0 - beta) * q, FLT_MIN))
            in_row = tile_v.index[None, :] < V
            q_term = torch.where(in_row, q * (ls2 - lm2), 0.0)
            row_loss = row_loss + beta * torch.where(in_row, p * (lt2 - lm2), 0.0) + (1.0 - beta) * q_term
            cross = cross + q_term
        loss[tile_c] = torch.where(valid, torch.sum(row_loss, dim=1) * LN2, 0.0)
        cross2 = torch.sum(cross, dim=1)
        g_scale = torch.where(valid, scale[tile_c], 0.0) * (grad_mult * (1.0 - beta) * LN2)
        for tile_v in hl.tile(V, block_size=block_v):
            ls2 = load_f32(student, tile_c, tile_v, row_mask, STREAM) * to_log2 - lse_s[:, None]
            lt2 = load_f32(teacher, tile_c, tile_v, row_mask, STREAM) * to_log2 - lse_t[:, None]
            q = exp2(ls2)
            lm2 = log2(torch.clamp_min(beta * exp2(lt2) + (1.0 - beta) * q, FLT_MIN))
            g = g_scale[:, None] * q * (ls2 - lm2 - cross2[:, None])
            student[tile_c, tile_v] = g.to(student.dtype)


def default_config(v_bucket: int) -> dict:
    """One row a program, blocks of up to 2048 columns (two inputs and up to three per-lane sums per thread)."""
    return row_config(v_bucket, 2048)


KL_PAIR = Kernel(_kl_pair, "jsd_loss_and_grad", default_config)
MIXTURE = Kernel(_mixture, "jsd_loss_and_grad", default_config)


@register_backend("jsd_loss_and_grad", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def jsd_loss_and_grad(student_logits, teacher_logits, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0,
                      grad_scale=None):
    """Per-row generalized JSD [C] fp32 (unscaled); student_logits are overwritten with grad_scale * dloss/dlogits."""
    loss, C, V = row_losses(student_logits)
    if C == 0:
        return loss
    args = (student_logits, teacher_logits, labels, row_scale(grad_scale, C, student_logits), loss,
            int(ignore_index), LOG2E / temperature, 1.0 / temperature)
    launch = dict(like=student_logits, shape_key=bucket(V), int64=needs_int64(student_logits, teacher_logits))
    if beta in (0.0, 1.0):
        KL_PAIR(*args, beta == 1.0, **launch)
    else:
        MIXTURE(*args, float(beta), **launch)
    return loss
