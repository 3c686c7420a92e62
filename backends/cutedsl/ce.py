"""Cross-entropy loss and gradient in one CuTeDSL kernel: one CTA per row, 2 passes, gradient over the logits.

Pass 1 streams the row for the online softmax state (and sum z for label smoothing), loading with an
evict-last L2 hint so that pass 2, which streams it again and writes grad_scale * dloss/dlogits in
place, can find it in L2.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._rows import row_losses
from . import _row
from ._row import (LN2, LOG2E, NEG_BIG, RowLaunch, RowTiles, block_lse, block_sum, online_softmax_step, tile_sum,
                   zero_row)
from ._support import (PRIORITY, CUTE_DTYPE, Launcher, Syms, cache, capability, compile_kernel, per_row,
                       pick_vec, row_limits, scale_view)

LAUNCH = LaunchKnobs("cutedsl ce_loss_and_grad", RowLaunch(threads=256, unroll=4))


class CrossEntropyKernel:
    def __init__(self, vec, launch, has_scale, has_softcap, has_smoothing):
        self.vec = vec
        self.launch = launch
        self.tile = launch.tile(vec)
        self.has_scale = has_scale
        self.has_softcap = has_softcap
        self.has_smoothing = has_smoothing

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mLoss: cute.Tensor, mScale: cute.Tensor | None,
                 scale_step: Int32, ignore_index: Int64, smoothing: Float32, lse_square_scale: Float32,
                 softcap: Float32, stream):
        self.kernel(mX, mTarget, mLoss, mScale, scale_step, ignore_index, smoothing, lse_square_scale, softcap).launch(
            grid=[mX.shape[0], 1, 1], block=[self.launch.threads, 1, 1], stream=stream)

    @cute.jit
    def logits(self, x: cute.TensorSSA, softcap: Float32):
        """z from the raw logits (softcap * tanh(x / softcap) when capped) and tanh itself (None if not capped)."""
        if const_expr(self.has_softcap):
            t = cute.math.tanh(x * (1.0 / softcap))
            return softcap * t, t
        return x, None

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mLoss: cute.Tensor, mScale: cute.Tensor | None,
               scale_step: Int32, ignore_index: Int64, smoothing: Float32, lse_square_scale: Float32,
               softcap: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        buf = _row.reduction_buffer(self.launch.warps, 3)
        tiles = RowTiles.of(mX, row, tidx, self.vec, self.launch)
        n_cols = mX.shape[1]
        n_full, tail = tiles.span()
        target = mTarget[row]
        loss = Float32(0.0)

        if target == ignore_index:
            zero_row(tiles, n_full, tail)
        else:
            y = Int32(target)
            # Read before pass 2 overwrites the row.
            z_y, _ = self.logits(Float32(mX[row, y]), softcap)

            lse2, z_sum = self.softmax_state(tiles, n_full, tail, softcap, buf)
            lse = lse2 * LN2
            loss = lse - (1.0 - smoothing) * z_y + lse_square_scale * lse * lse
            if const_expr(self.has_smoothing):
                (z_sum,) = block_sum((z_sum,), buf, 2)
                loss -= smoothing * z_sum / Float32(n_cols)

            # Pass 2: dloss/dz_j = (1 + 2 s lse) softmax_j - (1 - eps)[j == y] - eps / V, times dz/dx, times scale.
            scale = Float32(1.0)
            if const_expr(self.has_scale):
                scale = mScale[row * scale_step]
            p_coef = scale * (1.0 + 2.0 * lse_square_scale * lse)
            uniform = scale * smoothing / Float32(n_cols)
            on_target = scale * (1.0 - smoothing)
            self.write_grad(tiles, n_full, tail, y, softcap, lse2, p_coef, uniform, on_target)

        if tidx == 0:
            mLoss[row] = loss

    @cute.jit
    def softmax_state(self, tiles: RowTiles, n_full: Int32, tail: Boolean, softcap: Float32, buf: cute.Tensor):
        """Pass 1 over the row: (base-2 log-sum-exp of z, CTA-wide from slots 0-1 of buf; this thread's part of
        sum z with smoothing, else 0).

        Loads evict-last: a later pass reads the row again. Padding loads as 0 (z = 0 too), masked to -inf for the
        max and sum."""
        m = Float32(NEG_BIG)
        d = Float32(0.0)
        z_sum = Float32(0.0)
        for k in cutlass.range(n_full, unroll=1):
            z, _ = self.logits(tiles.load(k, keep=True), softcap)
            m, d = online_softmax_step(m, d, z * LOG2E)
            if const_expr(self.has_smoothing):
                z_sum += tile_sum(z)
        if tail:
            pred = tiles.predicate(n_full)
            z, _ = self.logits(tiles.load(n_full, pred, keep=True), softcap)
            m, d = online_softmax_step(m, d, cute.where(tiles.element_mask(pred), z * LOG2E, -Float32.inf))
            if const_expr(self.has_smoothing):
                z_sum += tile_sum(z)
        m, d = block_lse(m, d, buf, 0)
        return m + cute.math.log2(d, fastmath=True), z_sum

    @cute.jit
    def write_grad(self, tiles: RowTiles, n_full: Int32, tail: Boolean, y: Int32, softcap: Float32, lse2: Float32,
                   p_coef: Float32, uniform: Float32, on_target: Float32):
        """Pass 2: the gradient over the row (see grad); y may be any column index, or none of the row's."""
        for k in cutlass.range(n_full, unroll=1):
            tiles.store(k, self.grad(tiles.load(k), tiles.columns(k), y, softcap, lse2, p_coef, uniform, on_target))
        if tail:
            pred = tiles.predicate(n_full)
            g = self.grad(tiles.load(n_full, pred), tiles.columns(n_full), y, softcap, lse2, p_coef, uniform,
                          on_target)
            tiles.store(n_full, g, pred)

    @cute.jit
    def grad(self, x: cute.TensorSSA, cols: cute.TensorSSA, y: Int32, softcap: Float32, lse2: Float32,
             p_coef: Float32, uniform: Float32, on_target: Float32):
        z, t = self.logits(x, softcap)
        g = p_coef * cute.math.exp2(z * LOG2E - lse2, fastmath=True) - uniform
        g = cute.where(cols == y, g - on_target, g)
        if const_expr(self.has_softcap):
            g = g * (1.0 - t * t)
        return g


@cache
def _compiled(dtype, target_dtype, vec, launch, has_scale, has_softcap, has_smoothing):
    cdtype = CUTE_DTYPE[dtype]
    syms = Syms()
    kernel = CrossEntropyKernel(vec, launch, has_scale, has_softcap, has_smoothing)
    return Launcher(compile_kernel(
        kernel, syms.matrix(cdtype, vec), syms.per_row(CUTE_DTYPE[target_dtype]), syms.per_row(cutlass.Float32),
        syms.flat() if has_scale else None, 0, -100, 0.0, 0.0, 1.0,
    ))


def _limits(logits, target, **_):
    return row_limits(logits, target)


@register_backend("ce_loss_and_grad", backend="cutedsl", priority=PRIORITY, capability=capability(_limits))
def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                     lse_square_scale=0.0):
    """Per-row cross-entropy loss [C] fp32 (unscaled); logits are overwritten with grad_scale * dloss/dlogits."""
    loss, C, V = row_losses(logits)
    if C == 0:
        return loss
    scale, step = scale_view(grad_scale)
    target = per_row(target)
    run = _compiled(logits.dtype, target.dtype, pick_vec(V, logits), LAUNCH.current, scale is not None,
                    softcap is not None, label_smoothing != 0.0)
    run(logits, target, loss, scale, step, ignore_index, float(label_smoothing), float(lse_square_scale),
        float(softcap) if softcap is not None else 1.0)
    return loss
