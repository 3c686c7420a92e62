"""Cross-entropy loss and gradient in one kernel: 2 passes over each row, gradient written over the logits."""

import triton
import triton.language as tl

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._rows import row_losses
from ._support import (
    CAPABILITY, LOG2E, LN2, PRIORITY, RowLaunch,
    block_start, launch_row_kernel, load_block, load_scale, online_softmax_step, row_launch, scale_args, tanh,
    zero_row,
)


@triton.jit
def ce_row_stats(X, W, cols, softcap, inv_softcap, V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SUM: tl.constexpr,
                 HAS_WEIGHT: tl.constexpr, HAS_MAX: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Pass 1 over a row X of V logits, forward in blocks of cols = arange(BLOCK), z softcapped when HAS_SOFTCAP:
    (lse2 = log2 sum_j exp2(z_j log2 e); when HAS_SUM the per-lane sums of w_j z_j and w_j, W the row's class
    weights, 1 without HAS_WEIGHT (then the second sum is not kept); when HAS_MAX the per-lane max of z).
    Running max and per-lane sums of exp2."""
    m = -float("inf")
    d = tl.zeros([BLOCK], tl.float32)
    z_sum = tl.zeros([BLOCK], tl.float32)
    w_sum = tl.zeros([BLOCK], tl.float32)
    z_max = tl.full([BLOCK], -float("inf"), tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        z, mask = load_block(X, start, cols, V, "evict_last")
        if HAS_SOFTCAP:
            z = softcap * tanh(z * inv_softcap)
        m, alpha, e = online_softmax_step(m, tl.where(mask, z * LOG2E, -float("inf")))
        d = d * alpha + e
        if HAS_SUM:  # masked lanes hold z = 0 (tanh(0) = 0 too) and w = 0
            if HAS_WEIGHT:
                w, _ = load_block(W, start, cols, V, "evict_last")
                z_sum += w * z
                w_sum += w
            else:
                z_sum += z
        if HAS_MAX:
            z_max = tl.maximum(z_max, tl.where(mask, z, -float("inf")))
    return m + tl.log2(tl.sum(d, 0)), z_sum, w_sum, z_max


@triton.jit
def ce_row_grad(X, W, cols, y_col, lse2, p_coef, uniform, on_target, softcap, inv_softcap, V: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Pass 2 over a row X of V logits, backward (it begins on the blocks pass 1 left in L2), overwritten with
    (p_coef softmax_j - uniform w_j - on_target [j == y_col]) dz_j/dX_j, softmax_j = exp2(z_j log2 e - lse2), W the
    row's class weights (1 without HAS_WEIGHT). y_col is an int32 column (outside [0, V): no target in this row)."""
    for i in tl.range(0, (V + BLOCK - 1) // BLOCK, num_stages=NUM_STAGES):
        start = block_start(i, V, BLOCK, True)
        x, mask = load_block(X, start, cols, V, "evict_first")
        if HAS_SOFTCAP:
            t = tanh(x * inv_softcap)
            z = softcap * t
        else:
            z = x
        g = p_coef * tl.exp2(z * LOG2E - lse2) - tl.where(start + cols == y_col, on_target, 0.0)
        if HAS_WEIGHT:
            w, _ = load_block(W, start, cols, V, "evict_first")
            g -= uniform * w
        else:
            g -= uniform
        if HAS_SOFTCAP:
            g *= 1.0 - t * t
        tl.store(X + start + cols, g.to(X.dtype.element_ty), mask=mask)


@triton.jit
def ce_coefficients(scale, smoothing, inv_vocab, target_weight, weight_mean, lse, lse_square_scale):
    """(p_coef, uniform, on_target) of ce_row_grad for a row: d loss / dz_j = ((1 - eps) w_y + eps W / V + 2 s lse)
    softmax_j - eps w_j / V - (1 - eps) w_y [j == y], times scale (weight_mean = W / V, 1 without class weights)."""
    on_target = scale * (1.0 - smoothing) * target_weight
    p_coef = on_target + scale * (smoothing * weight_mean + 2.0 * lse_square_scale * lse)
    return p_coef, scale * smoothing * inv_vocab, on_target


@triton.jit
def load_weight(W, column, HAS_WEIGHT: tl.constexpr):
    """The class weight of a column (1 without HAS_WEIGHT)."""
    if HAS_WEIGHT:
        return tl.load(W + column).to(tl.float32)
    else:
        return 1.0


@triton.jit
def _ce_kernel(
    X, x_stride,  # [C, V] logits, overwritten by the gradient
    Y, y_stride,  # [C] int target classes, ignore_index for a skipped row
    LOSS,  # [C] fp32 per-row loss, written
    SCALE, scale_stride,  # [C] grad_scale (stride 0: one value for every row); unread without HAS_SCALE
    W,  # [V] class weights; unread without HAS_WEIGHT
    STATS, stats_stride,  # [C, 2] (lse, 1 if the target's logit is the row's max), written with HAS_STATS
    ignore_index, smoothing, lse_square_scale, softcap, inv_softcap,
    V: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_STATS: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * x_stride
    STATS += row * stats_stride
    y = tl.load(Y + row * y_stride)
    if y == ignore_index:
        zero_row(X, LOSS, row, V, BLOCK)
        if HAS_STATS:
            tl.store(STATS + tl.arange(0, 2), tl.zeros([2], tl.float32))
        return

    cols = tl.arange(0, BLOCK)
    # Pass 1: running max and sum of exp2 of z*log2(e), and the (weighted) sums of z for the smoothing term.
    z_y = tl.load(X + y).to(tl.float32)
    if HAS_SOFTCAP:
        z_y = softcap * tanh(z_y * inv_softcap)
    lse2, z_sum, w_sum, z_max = ce_row_stats(X, W, cols, softcap, inv_softcap, V, HAS_SOFTCAP, HAS_SMOOTHING,
                                             HAS_WEIGHT, HAS_STATS, BLOCK, NUM_STAGES)
    lse = lse2 * LN2
    w_y = load_weight(W, y, HAS_WEIGHT)

    # (1 - eps) w_y (lse - z_y) + eps / V sum_j w_j (lse - z_j) + s lse^2
    loss = (1.0 - smoothing) * w_y * (lse - z_y) + lse_square_scale * lse * lse
    weight_mean = 1.0
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            weight_mean = tl.sum(w_sum, 0) / V
        loss += smoothing * (weight_mean * lse - tl.sum(z_sum, 0) / V)
    tl.store(LOSS + row, loss)
    if HAS_STATS:
        tl.store(STATS, lse)
        tl.store(STATS + 1, (z_y >= tl.max(z_max, 0)).to(tl.float32))

    # Pass 2: the gradient, times dz/dlogits, times grad_scale.
    scale = load_scale(SCALE, scale_stride, row, HAS_SCALE)
    p_coef, uniform, on_target = ce_coefficients(scale, smoothing, 1.0 / V, w_y, weight_mean, lse, lse_square_scale)
    y_col = y.to(tl.int32)  # compared with int32 column offsets
    ce_row_grad(X, W, cols, y_col, lse2, p_coef, uniform, on_target, softcap, inv_softcap, V, HAS_SOFTCAP,
                HAS_WEIGHT and HAS_SMOOTHING, BLOCK, NUM_STAGES)


LAUNCH = LaunchKnobs("triton ce_loss_and_grad", RowLaunch())


@register_backend("ce_loss_and_grad", backend="triton", priority=PRIORITY, capability=CAPABILITY)
def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                     lse_square_scale=0.0, ce_weight=None, row_stats=None):
    """Per-row cross-entropy loss [C] fp32 (unscaled); logits are overwritten with grad_scale * dloss/dlogits."""
    loss, C, V = row_losses(logits)
    if C == 0:
        return loss
    scale, scale_stride, has_scale = scale_args(grad_scale, loss)
    cap = float(softcap or 1.0)
    launch_row_kernel(
        _ce_kernel, C,
        (logits, logits.stride(0), target, target.stride(0), loss, scale, scale_stride,
         loss if ce_weight is None else ce_weight, loss if row_stats is None else row_stats,
         0 if row_stats is None else row_stats.stride(0)),
        (ignore_index, float(label_smoothing), float(lse_square_scale), cap, 1.0 / cap),
        V=V, HAS_SCALE=has_scale, HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing != 0.0,
        HAS_WEIGHT=ce_weight is not None, HAS_STATS=row_stats is not None,
        **row_launch(V, logits, knobs=LAUNCH.current),
    )
    return loss
