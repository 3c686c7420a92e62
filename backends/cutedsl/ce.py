"""Cross-entropy loss and gradient in one CuTeDSL kernel: one CTA (or cluster, _row.py) per row, 2 passes, gradient
over the logits.

Pass 1 streams the row for the online softmax state (and sum w z, sum w for label smoothing, the max z for the
row statistics), loading with an evict-last L2 hint so that pass 2, which streams it again and writes
grad_scale * dloss/dlogits in place, can find it in L2. The vocab-parallel kernels (vocab_parallel.py) are these
passes too.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._rows import row_losses
from . import _row
from ._row import (LN2, LOG2E, NEG_BIG, RowLaunch, RowReductions, RowTiles, online_softmax_step, tile_max, tile_sum,
                   zero_row)
from ._support import (PRIORITY, CUTE_DTYPE, Launcher, Syms, cache, capability, compile_kernel, per_row,
                       pick_vec, row_limits, scale_view)

# Each row split across a cluster of 8 CTAs (_row.py), so that pass 2 finds the row in L2: 0.599 ms a 4096 x 128256
# bf16 chunk against 0.776 with a CTA per row (benchmarks/NOTES.md). With softcap or smoothing the kernel is
# compute-bound and a split costs (1.27 against 1.12 ms): those calls keep a CTA per row unless the knobs are set.
LAUNCH = LaunchKnobs("cutedsl ce_loss_and_grad", RowLaunch(threads=256, unroll=2, split=8))
COMPUTE_BOUND_LAUNCH = RowLaunch(threads=256, unroll=4)


def coefficients(scale: Float32, smoothing: Float32, inv_vocab: Float32, target_weight: Float32,
                 weight_mean: Float32, lse: Float32, lse_square_scale: Float32):
    """(p_coef, uniform, on_target) of a row's gradient: d loss / dz_j = ((1 - eps) w_y + eps W / V + 2 s lse)
    softmax_j - eps w_j / V - (1 - eps) w_y [j == y], times scale (weight_mean = W / V, 1 without class weights)."""
    on_target = scale * (1.0 - smoothing) * target_weight
    p_coef = on_target + scale * (smoothing * weight_mean + 2.0 * lse_square_scale * lse)
    return p_coef, scale * smoothing * inv_vocab, on_target


class CrossEntropyKernel:
    """One CTA per row (a cluster with launch.split > 1). With class weights (has_weight) mWeights holds one weight per class (indexed by the
    target's class) and, when smoothing reads them per column, mWeightRow [1, V] the weights of the row's columns;
    has_stats: pass 1 also keeps the row's max z, and the kernel writes (lse, target is the max) to mStats."""

    def __init__(self, vec, launch, has_scale, has_softcap, has_smoothing, has_weight=False, has_stats=False):
        self.vec = vec
        self.launch = launch
        self.tile = launch.tile(vec)
        self.has_scale = has_scale
        self.has_softcap = has_softcap
        self.has_smoothing = has_smoothing
        self.has_weight = has_weight
        self.has_stats = has_stats

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mLoss: cute.Tensor, mScale: cute.Tensor | None,
                 scale_step: Int32, mWeights: cute.Tensor | None, mWeightRow: cute.Tensor | None,
                 mStats: cute.Tensor | None, ignore_index: Int64, smoothing: Float32, lse_square_scale: Float32,
                 softcap: Float32, stream):
        self.kernel(mX, mTarget, mLoss, mScale, scale_step, mWeights, mWeightRow, mStats, ignore_index, smoothing,
                    lse_square_scale, softcap).launch(**self.launch.over_rows(mX.shape[0]), stream=stream)

    @cute.jit
    def logits(self, x: cute.TensorSSA, softcap: Float32):
        """z from the raw logits (softcap * tanh(x / softcap) when capped) and tanh itself (None if not capped)."""
        if const_expr(self.has_softcap):
            t = cute.math.tanh(x * (1.0 / softcap))
            return softcap * t, t
        return x, None

    def weight_tiles(self, mWeightRow: cute.Tensor | None, tidx, rank):
        """This thread's tiles of the row's class weights, or None where no pass reads them per column."""
        if const_expr(mWeightRow is None):
            return None
        return RowTiles.of(mWeightRow, 0, tidx, self.vec, self.launch, rank)

    def target_weight(self, mWeights: cute.Tensor | None, y: Int64):
        """The class weight of the row's target (1 without class weights)."""
        if const_expr(mWeights is None):
            return Float32(1.0)
        return Float32(mWeights[y])

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mLoss: cute.Tensor, mScale: cute.Tensor | None,
               scale_step: Int32, mWeights: cute.Tensor | None, mWeightRow: cute.Tensor | None,
               mStats: cute.Tensor | None, ignore_index: Int64, smoothing: Float32, lse_square_scale: Float32,
               softcap: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, rank = _row.place(self.launch)
        red = RowReductions.of(self.launch, 5)
        tiles = RowTiles.of(mX, row, tidx, self.vec, self.launch, rank)
        weights = self.weight_tiles(mWeightRow, tidx, rank)
        n_cols = mX.shape[1]
        n_full, tail = tiles.span()
        target = mTarget[row]
        loss = Float32(0.0)
        lse = Float32(0.0)
        correct = Float32(0.0)

        if target == ignore_index:
            zero_row(tiles, n_full, tail)
        else:
            y = Int32(target)
            # Read before pass 2 overwrites the row.
            z_y, _ = self.logits(Float32(mX[row, y]), softcap)
            w_y = self.target_weight(mWeights, target)

            lse2, z_sum, w_sum, z_max = self.softmax_state(tiles, weights, n_full, tail, softcap, red)
            lse = lse2 * LN2
            # (1 - eps) w_y (lse - z_y) + eps / V sum_j w_j (lse - z_j) + s lse^2
            loss = (1.0 - smoothing) * w_y * (lse - z_y) + lse_square_scale * lse * lse
            weight_mean = Float32(1.0)
            if const_expr(self.has_smoothing):
                z_sum, w_sum = red.sum((z_sum, w_sum), 2)
                if const_expr(self.has_weight):
                    weight_mean = w_sum / Float32(n_cols)
                loss += smoothing * (weight_mean * lse - z_sum / Float32(n_cols))
            if const_expr(self.has_stats):
                if z_y >= red.max(z_max, 4):
                    correct = Float32(1.0)

            # Pass 2: the gradient, times dz/dx, times scale.
            scale = Float32(1.0)
            if const_expr(self.has_scale):
                scale = mScale[row * scale_step]
            p_coef, uniform, on_target = coefficients(scale, smoothing, 1.0 / Float32(n_cols), w_y, weight_mean,
                                                      lse, lse_square_scale)
            self.write_grad(tiles, weights, n_full, tail, y, softcap, lse2, p_coef, uniform, on_target)

        if tidx == 0 and rank == 0:
            mLoss[row] = loss
            if const_expr(self.has_stats):
                mStats[row * 2] = lse
                mStats[row * 2 + 1] = correct
        red.done()

    def smoothing_sums(self, z_sum: Float32, w_sum: Float32, z: cute.TensorSSA, weights, k: Int32, pred=None):
        """This thread's sums sum_j w_j z_j and sum_j w_j after tile k (w = 1 without class weights: sum z alone).
        Padding loads as w = 0 and z = 0."""
        if const_expr(weights is None):
            return z_sum + tile_sum(z), w_sum
        w = weights.load(k, pred, keep=True)
        return z_sum + tile_sum(w * z), w_sum + tile_sum(w)

    @cute.jit
    def softmax_state(self, tiles: RowTiles, weights, n_full: Int32, tail: Boolean, softcap: Float32,
                      red: RowReductions):
        """Pass 1 over the row: (base-2 log-sum-exp of z, row-wide from slots 0-1; this thread's parts of
        sum w z and sum w with smoothing, else 0; this thread's max z with has_stats, else NEG_BIG).

        Loads evict-last: a later pass reads the row again. Padding loads as 0 (z = 0 too), masked to -inf for the
        max and sum."""
        m = Float32(NEG_BIG)
        d = Float32(0.0)
        z_sum = Float32(0.0)
        w_sum = Float32(0.0)
        z_max = Float32(NEG_BIG)
        for k in cutlass.range(n_full, unroll=1):
            z, _ = self.logits(tiles.load(k, keep=True), softcap)
            m, d = online_softmax_step(m, d, z * LOG2E)
            if const_expr(self.has_smoothing):
                z_sum, w_sum = self.smoothing_sums(z_sum, w_sum, z, weights, k)
            if const_expr(self.has_stats):
                z_max = cute.arch.fmax(z_max, tile_max(z))
        if tail:
            pred = tiles.predicate(n_full)
            z, _ = self.logits(tiles.load(n_full, pred, keep=True), softcap)
            in_row = tiles.element_mask(pred)
            m, d = online_softmax_step(m, d, cute.where(in_row, z * LOG2E, -Float32.inf))
            if const_expr(self.has_smoothing):
                z_sum, w_sum = self.smoothing_sums(z_sum, w_sum, z, weights, n_full, pred)
            if const_expr(self.has_stats):
                z_max = cute.arch.fmax(z_max, tile_max(cute.where(in_row, z, -Float32.inf)))
        m, d = red.lse(m, d, 0)
        return m + cute.math.log2(d, fastmath=True), z_sum, w_sum, z_max

    @cute.jit
    def write_grad(self, tiles: RowTiles, weights, n_full: Int32, tail: Boolean, y: Int32, softcap: Float32,
                   lse2: Float32, p_coef: Float32, uniform: Float32, on_target: Float32):
        """Pass 2: the gradient over the row (see grad); y may be any column index, or none of the row's."""
        for k in cutlass.range(n_full, unroll=1):
            g = self.grad(tiles.load(k), self.column_weights(weights, k), tiles.columns(k), y, softcap, lse2, p_coef,
                          uniform, on_target)
            tiles.store(k, g)
        if tail:
            pred = tiles.predicate(n_full)
            g = self.grad(tiles.load(n_full, pred), self.column_weights(weights, n_full, pred), tiles.columns(n_full),
                          y, softcap, lse2, p_coef, uniform, on_target)
            tiles.store(n_full, g, pred)

    def column_weights(self, weights, k: Int32, pred=None):
        """Tile k's class weights (kept in L2: every row reads them), or None without per-column weights."""
        if const_expr(weights is None):
            return None
        return weights.load(k, pred, keep=True)

    @cute.jit
    def grad(self, x: cute.TensorSSA, w, cols: cute.TensorSSA, y: Int32, softcap: Float32, lse2: Float32,
             p_coef: Float32, uniform: Float32, on_target: Float32):
        z, t = self.logits(x, softcap)
        g = p_coef * cute.math.exp2(z * LOG2E - lse2, fastmath=True)
        if const_expr(w is None):
            g = g - uniform
        else:
            g = g - uniform * w
        g = cute.where(cols == y, g - on_target, g)
        if const_expr(self.has_softcap):
            g = g * (1.0 - t * t)
        return g


@cache
def _compiled(dtype, target_dtype, vec, launch, has_scale, has_softcap, has_smoothing, has_weight=False,
              has_stats=False):
    cdtype = CUTE_DTYPE[dtype]
    syms = Syms()
    kernel = CrossEntropyKernel(vec, launch, has_scale, has_softcap, has_smoothing, has_weight, has_stats)
    per_column = has_weight and has_smoothing
    return Launcher(compile_kernel(
        kernel, syms.matrix(cdtype, vec), syms.per_row(CUTE_DTYPE[target_dtype]), syms.per_row(cutlass.Float32),
        syms.flat() if has_scale else None, 0, syms.flat() if has_weight else None,
        syms.row_vector(cutlass.Float32, vec) if per_column else None, syms.flat() if has_stats else None,
        -100, 0.0, 0.0, 1.0,
    ))


def _limits(logits, target, **_):
    return row_limits(logits, target)


def weight_views(ce_weight, start, width, smoothing):
    """(the class weights as the kernels index them by class, their [1, width] row from column `start` when the
    smoothing term reads them per column, else None); (None, None) without class weights."""
    if ce_weight is None:
        return None, None
    ce_weight = ce_weight.float()  # what the kernels were compiled for (no copy when it is fp32 already)
    return ce_weight, ce_weight[start:start + width].view(1, width) if smoothing else None


@register_backend("ce_loss_and_grad", backend="cutedsl", priority=PRIORITY, capability=capability(_limits))
def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                     lse_square_scale=0.0, ce_weight=None, row_stats=None):
    """Per-row cross-entropy loss [C] fp32 (unscaled); logits are overwritten with grad_scale * dloss/dlogits."""
    loss, C, V = row_losses(logits)
    if C == 0:
        return loss
    scale, step = scale_view(grad_scale)
    target = per_row(target)
    weights, weight_row = weight_views(ce_weight, 0, V, label_smoothing != 0.0)
    vec = pick_vec(V, logits, *(() if weight_row is None else (weight_row,)))
    compute_bound = softcap is not None or label_smoothing != 0.0
    launch = LAUNCH.current_or(COMPUTE_BOUND_LAUNCH if compute_bound else LAUNCH.default)
    run = _compiled(logits.dtype, target.dtype, vec, launch, scale is not None, softcap is not None,
                    label_smoothing != 0.0, ce_weight is not None, row_stats is not None)
    run(logits, target, loss, scale, step, weights, weight_row, None if row_stats is None else row_stats.view(-1),
        ignore_index, float(label_smoothing), float(lse_square_scale), float(softcap) if softcap is not None else 1.0)
    return loss
