"""KL(target || softmax(student / T)) against explicit target probabilities: loss and student gradient as one
Helion kernel, 2 passes over each row.

Pass 1 builds the student's softmax statistics and sum_k q_k; pass 2 accumulates the loss element by element
(no cancellation between large terms) and writes dL/ds_j = softmax_j * sum_k q_k - q_j over the student logits
(times 1/T and grad_scale). The target is only read.
"""

from typing import Optional

import torch
import helion.language as hl

from liger_dispatch import register_backend

from .._rows import row_losses
from ._support import (
    CAPABILITY, KEEP, LN2, LOG2E, PRIORITY, STREAM, Kernel, bucket, exp2, load_f32, log2, needs_int64,
    online_softmax_step, row_config, row_scale, valid_rows,
)


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
            s2 = load_f32(student, tile_c, tile_v, row_mask, KEEP)
            tq = load_f32(target, tile_c, tile_v, row_mask, KEEP)
            in_row = tile_v.index[None, :] < V
            m, alpha, e = online_softmax_step(m, s2 * to_log2, in_row)
            d = d * alpha + e
            q = exp2(tq * LOG2E) if log_target else tq
            q_sum = q_sum + torch.where(in_row, q, 0.0)
        lse2 = m + log2(torch.sum(d, dim=1))
        total_q = torch.sum(q_sum, dim=1)

        g_scale = torch.where(valid, scale[tile_c], 0.0) * grad_mult
        row_loss = hl.zeros([tile_c, block_v], dtype=torch.float32)
        for tile_v in hl.tile(V, block_size=block_v):
            s2 = load_f32(student, tile_c, tile_v, row_mask, STREAM)
            tq = load_f32(target, tile_c, tile_v, row_mask, STREAM)
            in_row = tile_v.index[None, :] < V
            if log_target:
                q = exp2(tq * LOG2E)
                log_q = tq
            else:
                q = tq
                log_q = log2(torch.clamp_min(q, eps)) * LN2
            ls2 = s2 * to_log2 - lse2[:, None]
            # 0 log 0 = 0, also where log q is -inf (eps = 0, or a log-target of -inf)
            row_loss = row_loss + torch.where(in_row & (q > 0.0), q * (log_q - ls2 * LN2), 0.0)
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
        int(ignore_index), LOG2E / temperature, 1.0 / temperature, float(eps), bool(log_target),
        like=student_logits, shape_key=bucket(V), int64=needs_int64(student_logits, target),
    )
    return loss
