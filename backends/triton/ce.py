"""Cross-entropy loss and gradient in one kernel: 2 passes over each row, gradient written over the logits."""

import triton
import triton.language as tl

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._rows import row_losses
from ._support import (
    CAPABILITY, LOG2E, LN2, PRIORITY, RowLaunch,
    block_start, load_block, load_scale, online_softmax_step, row_launch, scale_args, tanh, zero_row,
)


@triton.jit
def ce_row_stats(X, cols, softcap, inv_softcap, V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SUM: tl.constexpr,
                 BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Pass 1 over a row X of V logits, forward in blocks of cols = arange(BLOCK): (lse2 = log2 sum_j exp2(z_j log2 e),
    the per-lane sums of z when HAS_SUM), z softcapped when HAS_SOFTCAP. Running max and per-lane sums of exp2."""
    m = -float("inf")
    d = tl.zeros([BLOCK], tl.float32)
    z_sum = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        z, mask = load_block(X, start, cols, V, "evict_last")
        if HAS_SOFTCAP:
            z = softcap * tanh(z * inv_softcap)
        m, alpha, e = online_softmax_step(m, tl.where(mask, z * LOG2E, -float("inf")))
        d = d * alpha + e
        if HAS_SUM:
            z_sum += z  # masked lanes hold 0 (tanh(0) = 0 too)
    return m + tl.log2(tl.sum(d, 0)), z_sum


@triton.jit
def ce_row_grad(X, cols, y_col, lse2, p_coef, uniform, on_target, softcap, inv_softcap, V: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Pass 2 over a row X of V logits, backward (it begins on the blocks pass 1 left in L2), overwritten with
    (p_coef softmax_j - uniform - on_target [j == y_col]) dz_j/dX_j, softmax_j = exp2(z_j log2 e - lse2). y_col is
    an int32 column (outside [0, V): no target in this row)."""
    for i in tl.range(0, (V + BLOCK - 1) // BLOCK, num_stages=NUM_STAGES):
        start = block_start(i, V, BLOCK, True)
        x, mask = load_block(X, start, cols, V, "evict_first")
        if HAS_SOFTCAP:
            t = tanh(x * inv_softcap)
            z = softcap * t
        else:
            z = x
        g = p_coef * tl.exp2(z * LOG2E - lse2) - uniform - tl.where(start + cols == y_col, on_target, 0.0)
        if HAS_SOFTCAP:
            g *= 1.0 - t * t
        tl.store(X + start + cols, g.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _ce_kernel(
    X, x_stride,  # [C, V] logits, overwritten by the gradient
    Y, y_stride,  # [C] int target classes, ignore_index for a skipped row
    LOSS,  # [C] fp32 per-row loss, written
    SCALE, scale_stride,  # [C] grad_scale (stride 0: one value for every row); unread without HAS_SCALE
    ignore_index, smoothing, lse_square_scale, softcap, inv_softcap,
    V: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr,
    BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * x_stride
    y = tl.load(Y + row * y_stride)
    if y == ignore_index:
        zero_row(X, LOSS, row, V, BLOCK)
        return

    cols = tl.arange(0, BLOCK)
    # Pass 1: running max and sum of exp2 of z*log2(e), and sum z for the smoothing term.
    z_y = tl.load(X + y).to(tl.float32)
    if HAS_SOFTCAP:
        z_y = softcap * tanh(z_y * inv_softcap)
    lse2, z_sum = ce_row_stats(X, cols, softcap, inv_softcap, V, HAS_SOFTCAP, HAS_SMOOTHING, BLOCK, NUM_STAGES)
    lse = lse2 * LN2

    loss = lse - (1.0 - smoothing) * z_y + lse_square_scale * lse * lse
    if HAS_SMOOTHING:
        loss -= smoothing * tl.sum(z_sum, 0) / V
    tl.store(LOSS + row, loss)

    # Pass 2: dloss/dz_j = (1 + 2 s lse) softmax_j - (1 - eps)[j == y] - eps / V, times dz/dlogits, times grad_scale.
    scale = load_scale(SCALE, scale_stride, row, HAS_SCALE)
    p_coef = scale * (1.0 + 2.0 * lse_square_scale * lse)
    uniform = scale * smoothing / V
    on_target = scale * (1.0 - smoothing)
    y_col = y.to(tl.int32)  # compared with int32 column offsets
    ce_row_grad(X, cols, y_col, lse2, p_coef, uniform, on_target, softcap, inv_softcap, V, HAS_SOFTCAP, BLOCK,
                NUM_STAGES)


LAUNCH = LaunchKnobs("triton ce_loss_and_grad", RowLaunch())


@register_backend("ce_loss_and_grad", backend="triton", priority=PRIORITY, capability=CAPABILITY)
def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                     lse_square_scale=0.0):
    """Per-row cross-entropy loss [C] fp32 (unscaled); logits are overwritten with grad_scale * dloss/dlogits."""
    loss, C, V = row_losses(logits)
    if C == 0:
        return loss
    scale, scale_stride, has_scale = scale_args(grad_scale, loss)
    cap = float(softcap or 1.0)
    _ce_kernel[(C,)](
        logits, logits.stride(0), target, target.stride(0), loss, scale, scale_stride,
        ignore_index, float(label_smoothing), float(lse_square_scale), cap, 1.0 / cap,
        V=V, HAS_SCALE=has_scale, HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing != 0.0,
        **row_launch(V, logits, knobs=LAUNCH.current),
    )
    return loss
