"""Cross-entropy loss and gradient as one Helion kernel: 2 passes over each row, gradient written over the logits.

Pass 1 runs an online softmax in base 2 (running max per row, per-lane sums rescaled as the max moves, reduced
once at the end) and gathers the target logit; pass 2 writes, with class weights w (1 without) and W = sum_j w_j,
    grad_scale * (((1 - eps) w_y + eps W / V + 2 s lse) softmax_j - (1 - eps) w_y [j == y] - eps w_j / V) * dz/dlogits.
The helpers below are inlined into the vocab-parallel kernels too (vocab_parallel.py).
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


def class_weights(weights: Optional[torch.Tensor], tile_v, offset: int, V: int) -> torch.Tensor:
    """[1, block] fp32 class weights of columns offset + tile_v (0 past the row end); only with weights."""
    return hl.load(weights, [tile_v.index + offset], extra_mask=tile_v.index < V).to(torch.float32).unsqueeze(0)


def target_weight(weights: Optional[torch.Tensor], tile_c, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each row's w_y (1 without class weights)."""
    if weights is None:
        return hl.full([tile_c], 1.0, dtype=torch.float32)
    return hl.load(weights, [torch.where(valid, y, 0)]).to(torch.float32)


def smoothing_sums(z_sum, w_sum, z, weights, tile_v, offset, V):
    """The per-lane sums sum_j w_j z_j and sum_j w_j after one block (w = 1 without class weights; then only z)."""
    if weights is None:
        return z_sum + z, w_sum
    w = class_weights(weights, tile_v, offset, V)
    return z_sum + w * z, w_sum + w


def coefficients(g_scale, smoothing, inv_vocab, w_y, weight_mean, lse, lse_square_scale):
    """(p_coef, uniform, on_target) per row: d loss / dz_j = ((1 - eps) w_y + eps W / V + 2 s lse) softmax_j
    - eps w_j / V - (1 - eps) w_y [j == y], times g_scale (weight_mean = W / V, 1 without class weights)."""
    on_target = g_scale * (1.0 - smoothing) * w_y
    p_coef = on_target + g_scale * (smoothing * weight_mean + 2.0 * lse_square_scale * lse)
    return p_coef, g_scale * (smoothing * inv_vocab), on_target


def grad_block(x, y_local, lse2, p_coef, uniform, on_target, weights, tile_v, offset, V, softcap):
    """One block of a row's gradient over the raw logits x [rows, block]; y_local: the target's column here.
    (Helpers index with unsqueeze: Helion rewrites t[:, None] in a kernel's own body only.)"""
    if softcap is not None:
        t = torch.tanh(x / softcap)
        z = softcap * t
    else:
        z = x
    p = exp2(z * LOG2E - lse2.unsqueeze(1))
    hit = tile_v.index.unsqueeze(0) == y_local.unsqueeze(1)
    g = p_coef.unsqueeze(1) * p - torch.where(hit, on_target.unsqueeze(1), 0.0)
    if weights is None:
        g = g - uniform.unsqueeze(1)
    else:
        g = g - uniform.unsqueeze(1) * class_weights(weights, tile_v, offset, V)
    if softcap is not None:
        g = g * (1.0 - t * t)
    return g


def _ce(
    logits: torch.Tensor,  # [C, V] logits, overwritten by the gradient
    logits_flat: torch.Tensor,  # logits' storage as 1-D, for the target gather
    row_stride: int,
    target: torch.Tensor,  # [C] target classes, ignore_index for a skipped row
    scale: torch.Tensor,  # [C] grad_scale per row
    loss: torch.Tensor,  # [C] fp32 per-row loss, written
    weights: Optional[torch.Tensor],  # [V] class weights, or None
    stats: Optional[torch.Tensor],  # [C, 2] (lse, 1 if the target's logit is the row's max), written; or None
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
        w_y = target_weight(weights, tile_c, y, valid)
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
            if smoothing is not None:  # lanes past V loaded 0 (and tanh(0) = 0)
                z_sum, w_sum = smoothing_sums(z_sum, w_sum, z, weights, tile_v, 0, V)
            if stats is not None:
                z_max = torch.maximum(z_max, torch.where(in_row, z, float("-inf")))
        lse2 = m + log2(torch.sum(d, dim=1))
        lse = lse2 * LN2
        row_loss = (1.0 - (smoothing or 0.0)) * w_y * (lse - z_y) + lse_square_scale * lse * lse
        weight_mean = hl.full([tile_c], 1.0, dtype=torch.float32)
        if smoothing is not None:
            if weights is not None:
                weight_mean = torch.sum(w_sum, dim=1) / V
            row_loss = row_loss + smoothing * (weight_mean * lse - torch.sum(z_sum, dim=1) / V)
        loss[tile_c] = torch.where(valid, row_loss, 0.0)
        if stats is not None:
            stats[tile_c, 0] = torch.where(valid, lse, 0.0)
            stats[tile_c, 1] = torch.where(valid & (z_y >= torch.amax(z_max, dim=1)), 1.0, 0.0)

        g_scale = torch.where(valid, scale[tile_c], 0.0)
        p_coef, uniform, on_target = coefficients(g_scale, smoothing or 0.0, 1.0 / V, w_y, weight_mean, lse,
                                                  lse_square_scale)
        for tile_v in hl.tile(V, block_size=block_v):
            x = load_f32(logits, tile_c, tile_v, row_mask, STREAM)
            if smoothing is not None:  # only the smoothing term reads the weights per column
                g = grad_block(x, y, lse2, p_coef, uniform, on_target, weights, tile_v, 0, V, softcap)
            else:
                g = grad_block(x, y, lse2, p_coef, uniform, on_target, None, tile_v, 0, V, softcap)
            logits[tile_c, tile_v] = g.to(logits.dtype)


def default_config(v_bucket: int) -> dict:
    """One row a program, blocks of up to 4096 columns, 16 fp32 lanes a thread."""
    return row_config(v_bucket, 4096)


KERNEL = Kernel(_ce, "ce_loss_and_grad", default_config)


@register_backend("ce_loss_and_grad", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                     lse_square_scale=0.0, ce_weight=None, row_stats=None):
    """Per-row cross-entropy loss [C] fp32 (unscaled); logits are overwritten with grad_scale * dloss/dlogits."""
    loss, C, V = row_losses(logits)
    if C == 0:
        return loss
    KERNEL(
        logits, flat_rows(logits), logits.stride(0), target, row_scale(grad_scale, C, logits), loss, ce_weight,
        row_stats, int(ignore_index), float(label_smoothing) if label_smoothing else None, float(lse_square_scale),
        None if softcap is None else float(softcap),
        like=logits, shape_key=bucket(V), int64=needs_int64(logits),
    )
    return loss

