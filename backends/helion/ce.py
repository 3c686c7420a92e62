"""Cross-entropy loss and gradient as one Helion kernel: 2 passes over each row, gradient written over the logits.

Pass 1 runs an online softmax in base 2 (running max per row, per-lane sums rescaled as the max moves, reduced
once at the end) and gathers the target logit; pass 2 writes
    grad_scale * ((1 + 2 s lse) softmax_j - (1 - eps)[j == y] - eps / V) * dz/dlogits.
Ignored rows load nothing (masked) and get loss 0 and a zero gradient.
"""

from typing import Optional

import torch
import helion.language as hl

from liger_dispatch import register_backend

from .._rows import row_losses
from ._support import (
    CAPABILITY, KEEP, LN2, LOG2E, PRIORITY, STREAM, Kernel, bucket, exp2, flat_rows, load_f32, log2,
    needs_int64, online_softmax_step, row_config, row_scale,
)


def _ce(
    logits: torch.Tensor,
    logits_flat: torch.Tensor,
    row_stride: int,
    target: torch.Tensor,
    scale: torch.Tensor,
    loss: torch.Tensor,
    ignore_index: int,
    smoothing: Optional[float],
    lse_square_scale: float,
    softcap: Optional[float],
) -> None:
    C, V = logits.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        y = target[tile_c].to(torch.int32)
        valid = y != ignore_index
        z_y = hl.load(logits_flat, [tile_c.index * row_stride + torch.where(valid, y, 0)]).to(torch.float32)
        if softcap is not None:
            z_y = softcap * torch.tanh(z_y / softcap)
        row_mask = valid[:, None]  # ignored rows are never read
        m = hl.full([tile_c], float("-inf"), dtype=torch.float32)
        d = hl.zeros([tile_c, block_v], dtype=torch.float32)
        z_sum = hl.zeros([tile_c, block_v], dtype=torch.float32)
        for tile_v in hl.tile(V, block_size=block_v):
            z = load_f32(logits, tile_c, tile_v, row_mask, KEEP)
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            m, alpha, e = online_softmax_step(m, z * LOG2E, tile_v.index[None, :] < V)
            d = d * alpha + e
            if smoothing is not None:
                z_sum = z_sum + z  # lanes past V loaded 0 (and tanh(0) = 0)
        lse2 = m + log2(torch.sum(d, dim=1))
        lse = lse2 * LN2
        row_loss = lse + lse_square_scale * lse * lse
        on_target = hl.full([tile_c], 1.0, dtype=torch.float32)
        uniform = hl.zeros([tile_c], dtype=torch.float32)
        if smoothing is not None:
            row_loss = row_loss - smoothing * torch.sum(z_sum, dim=1) / V
            on_target = on_target - smoothing
            uniform = uniform + smoothing / V
        row_loss = row_loss - on_target * z_y
        loss[tile_c] = torch.where(valid, row_loss, 0.0)

        g_scale = torch.where(valid, scale[tile_c], 0.0)
        p_coef = g_scale * (1.0 + 2.0 * lse_square_scale * lse)
        on_target = g_scale * on_target
        uniform = g_scale * uniform
        for tile_v in hl.tile(V, block_size=block_v):
            x = load_f32(logits, tile_c, tile_v, row_mask, STREAM)
            if softcap is not None:
                t = torch.tanh(x / softcap)
                z = softcap * t
            else:
                z = x
            p = exp2(z * LOG2E - lse2[:, None])
            hit = tile_v.index[None, :] == y[:, None]
            g = p_coef[:, None] * p - uniform[:, None] - torch.where(hit, on_target[:, None], 0.0)
            if softcap is not None:
                g = g * (1.0 - t * t)
            logits[tile_c, tile_v] = g.to(logits.dtype)


def default_config(v_bucket: int) -> dict:
    """One row a program, blocks of up to 4096 columns, 16 fp32 lanes a thread."""
    return row_config(v_bucket, 4096)


KERNEL = Kernel(_ce, "ce_loss_and_grad", default_config)


@register_backend("ce_loss_and_grad", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                     lse_square_scale=0.0):
    """Per-row cross-entropy loss [C] fp32 (unscaled); logits are overwritten with grad_scale * dloss/dlogits."""
    loss, C, V = row_losses(logits)
    if C == 0:
        return loss
    KERNEL(
        logits, flat_rows(logits), logits.stride(0), target, row_scale(grad_scale, C, logits), loss,
        int(ignore_index), float(label_smoothing) if label_smoothing else None, float(lse_square_scale),
        None if softcap is None else float(softcap),
        like=logits, shape_key=bucket(V), int64=needs_int64(logits),
    )
    return loss

