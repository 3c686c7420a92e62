"""KL(target || softmax(student / T)) against explicit target probabilities: loss and student gradient as one
Helion kernel, 2 passes over each row.

Pass 1 builds the student's softmax statistics and sum_k q_k; pass 2 accumulates the loss element by element
(no cancellation between large terms) and writes dL/ds_j = softmax_j * sum_k q_k - q_j over the student logits
(times 1/T and grad_scale). The target is only read.

Targets (benchmarks/kl_semantics.md): 0 log 0 = 0, also for eps = 0 and a log-target of -inf; a negative
probability makes its row's loss NaN (torch's kl_div: NaN) and leaves the gradient softmax * sum q - q as torch's;
log-targets may be unnormalized, q = e^target to about an ulp (precise_exp).
"""

from typing import Optional

import torch
import helion.language as hl

from liger_dispatch import register_backend

from .._rows import row_losses
from ._support import (
    CAPABILITY, FLT_MIN, KEEP, LN2, LOG2E, PRIORITY, STREAM, Kernel, bucket, exp2, load_f32, log2, needs_int64,
    row_config, row_scale, valid_rows,
)

LN2_HI = 0.693145751953125  # ln 2 to 12 significant bits: n * LN2_HI is exact for |n| < 2^12
LN2_LO = 1.4286068203094173e-06  # ln 2 - LN2_HI


def precise_exp(x):
    """e^x to about an ulp, for log-targets (Cody-Waite): 2^n * 2^(r log2 e) with n = round(x log2 e), |n| <= 127,
    and r = x - n ln 2 (as backends/triton/kl_div.py).

    exp2(x * log2 e) rounds the product, an error of up to 2^-24 |x log2 e| in the exponent (4e-7 relative at
    |x| = 12, 7 ulps), which the loss and the gradient inherit. -inf gives 0, +inf inf, NaN NaN.
    """
    y = torch.clamp(x * LOG2E, -126.0, 127.0)
    n = (y + torch.where(y < 0.0, -0.5, 0.5)).to(torch.int32).to(torch.float32)  # nearest (the cast truncates)
    r = (x - n * LN2_HI) - n * LN2_LO
    return exp2(n) * exp2(r * LOG2E)


def shifted_softmax_step(m, s, in_row, to_log2):
    """online_softmax_step on raw logits s, the running max m of s subtracted before the base-2 scaling (as
    backends/triton/kl_div.py): s * to_log2 - m2 rounds at the size of the logit, 2^-24 |s2| in the exponent of
    every softmax entry, which the gradient's softmax * sum q amplifies when sum q >> 1; s - m is exact near the max.
    """
    m_new = torch.maximum(m, torch.amax(torch.where(in_row, s, float("-inf")), dim=1))
    alpha = exp2((m - m_new) * to_log2).unsqueeze(1)
    return m_new, alpha, torch.where(in_row, exp2((s - m_new.unsqueeze(1)) * to_log2), 0.0)


def target_log(tq, eps, log_target):
    """(q, log q) of a block of KL targets: log max(q, eps), NaN for a negative probability; q = e^t, log q = t."""
    if log_target:
        return precise_exp(tq), tq
    log_q = log2(torch.clamp_min(tq, eps)) * LN2
    return tq, torch.where(tq < 0.0, float("nan"), log_q)


def _kl_div(
    student: torch.Tensor, target: torch.Tensor, labels: Optional[torch.Tensor], scale: torch.Tensor,
    loss: torch.Tensor, ignore_index: int, to_log2: float, grad_mult: float, eps: float, log_target: hl.constexpr,
) -> None:
    C, V = student.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        valid = valid_rows(labels, tile_c, ignore_index)
        row_mask = valid[:, None]  # ignored rows are never read
        m = hl.full([tile_c], float("-inf"), dtype=torch.float32)
        d = hl.zeros([tile_c, block_v], dtype=torch.float32)
        q_sum = hl.zeros([tile_c, block_v], dtype=torch.float32)
        for tile_v in hl.tile(V, block_size=block_v):
            s = load_f32(student, tile_c, tile_v, row_mask, KEEP)
            tq = load_f32(target, tile_c, tile_v, row_mask, KEEP)
            in_row = tile_v.index[None, :] < V
            m, alpha, e = shifted_softmax_step(m, s, in_row, to_log2)
            d = d * alpha + e
            q = precise_exp(tq) if log_target else tq
            q_sum = q_sum + torch.where(in_row, q, 0.0)
        lse2 = log2(torch.sum(d, dim=1))  # of (s - m) / T in base 2
        total_q = torch.sum(q_sum, dim=1)

        g_scale = torch.where(valid, scale[tile_c], 0.0) * grad_mult
        row_loss = hl.zeros([tile_c, block_v], dtype=torch.float32)
        for tile_v in hl.tile(V, block_size=block_v):
            s = load_f32(student, tile_c, tile_v, row_mask, STREAM)
            tq = load_f32(target, tile_c, tile_v, row_mask, STREAM)
            in_row = tile_v.index[None, :] < V
            q, log_q = target_log(tq, eps, log_target)
            ls2 = (s - m[:, None]) * to_log2 - lse2[:, None]
            # 0 log 0 = 0, also where log q is -inf (eps = 0, or a log-target of -inf); NaN for q < 0
            row_loss = row_loss + torch.where(in_row & (q != 0.0), q * (log_q - ls2 * LN2), 0.0)
            g = g_scale[:, None] * (exp2(ls2) * total_q[:, None] - q)
            student[tile_c, tile_v] = g.to(student.dtype)
        loss[tile_c] = torch.where(valid, torch.sum(row_loss, dim=1), 0.0)


def default_config(v_bucket: int) -> dict:
    """One row a program, blocks of up to 2048 columns (two inputs and two per-lane sums per thread)."""
    return row_config(v_bucket, 2048)


KERNEL = Kernel(_kl_div, "kl_div_loss_and_grad", default_config)


@register_backend("kl_div_loss_and_grad", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def kl_div_loss_and_grad(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                         log_target=False, grad_scale=None):
    """Per-row KL [C] fp32 (unscaled); student_logits are overwritten with grad_scale * dloss/dlogits."""
    loss, C, V = row_losses(student_logits)
    if C == 0:
        return loss
    KERNEL(
        student_logits, target, labels, row_scale(grad_scale, C, student_logits), loss,
        int(ignore_index), LOG2E / temperature, 1.0 / temperature, max(float(eps), FLT_MIN), bool(log_target),
        like=student_logits, shape_key=bucket(V), int64=needs_int64(student_logits, target),
    )
    return loss
