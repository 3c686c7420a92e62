"""Per-token log-probs and entropy (registry/logprobs.py) as CuTeDSL kernels: one CTA per row of a logits slice,
one pass over the row per kernel, built on _row.py as ce.py is.

    logprobs_stats: an online softmax in base 2 carrying, per thread, the running max m, d = sum exp2(u - m) and
        t = sum exp2(u - m) u (u = z log2 e, z = x / T); the CTA merges (m, d) with block_lse, then sums each
        thread's t rescaled to the CTA's max -> (lse, z_target where this slice holds the target,
        mean z = ln 2 t / d).
    logprobs_grad:  dz_j = (g (1[j = target] - p_j) - h p_j (z_j - mean)) / T from the global statistics, written
        over the logits (rounded to their dtype, streaming stores); a None g or h is a compile-time flag: not read,
        its term not computed.

The statistics pass is the last read of the row in the forward (the gradient pass runs in the backward), so both
load evict-first. Statistics are fp32 and natural-log, written through a flat view: row r's column j at 3r + j.

Compiled for sm_90a and checked for spills on the CPU (tests/test_logprobs_kernels.py); `pytest -m gpu` runs them.
"""

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._vp_rows import row_stats
from . import _row
from ._row import LN2, LOG2E, RowLaunch, RowTiles, block_lse, block_sum, tile_sum, zero_row
from ._support import CUTE_DTYPE, Launcher, Syms, cache, capability, compile_kernel, per_row, pick_vec, row_limits
from ._support import scale_view

# After triton (20), before helion (30), as the vocab-parallel kernels: these compile for sm_90a on the CPU but have
# not run on a GPU yet, so auto selection takes Triton's; backend="cutedsl" or LIGER_BACKEND picks them. Set it to
# _support.PRIORITY (10) once tests/test_logprobs_kernels.py has passed on a GPU.
UNTESTED_PRIORITY = 25

LAUNCH = LaunchKnobs("cutedsl logprobs ops", RowLaunch(threads=256, unroll=4))  # both kernels' (one input each)
STATS_COLUMNS = 3
# The padding of a row's last tile. A thread whose tile is all padding (a row shorter than the CTA's tile) has
# m = PAD and sums exp2(0) * PAD over its elements into t: with _row.NEG_BIG (-3e38) as padding that sum overflows
# to -inf and its weight exp2(PAD - m_row) = 0 makes NaN. -1e30 stays finite over any tile and vanishes under exp2.
PAD = -1.0e30


def _launch(kernel, mX, *args, stream):
    """One CTA per row of mX."""
    kernel.kernel(mX, *args).launch(grid=[mX.shape[0], 1, 1], block=[kernel.launch.threads, 1, 1], stream=stream)


@cute.jit
def softmax_moment_step(m: Float32, d: Float32, t: Float32, u: cute.TensorSSA):
    """One tile of the online softmax in base 2 that also carries t = sum exp2(u - m) u: _row.online_softmax_step's
    (m, d) update, with its exp2 kept for t (one exp2 per element: two would make the pass bound by the SFU).
    u = z log2 e; padding PAD, not -inf, so that its exp2(u - m) u is 0 * finite = 0."""
    m_new = cute.arch.fmax(m, u.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0))
    alpha = cute.math.exp2(m - m_new, fastmath=True)
    e = cute.math.exp2(u - m_new, fastmath=True)
    return m_new, d * alpha + tile_sum(e), t * alpha + tile_sum(e * u)


class LogprobsStatsKernel:
    """(lse, z_target if this slice holds the target else 0, mean z) per row; zeros for an ignored row."""

    def __init__(self, vec, launch):
        self.vec = vec
        self.launch = launch

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mStats: cute.Tensor, vocab_start: Int64,
                 ignore_index: Int64, inv_temp: Float32, stream):
        _launch(self, mX, mTarget, mStats, vocab_start, ignore_index, inv_temp, stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mStats: cute.Tensor, vocab_start: Int64,
               ignore_index: Int64, inv_temp: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        buf = _row.reduction_buffer(self.launch.warps, 3)
        tiles = RowTiles.of(mX, row, tidx, self.vec, self.launch)
        n_full, tail = tiles.span()
        target = mTarget[row]
        lse = Float32(0.0)
        z_y = Float32(0.0)
        mean = Float32(0.0)
        if target != ignore_index:
            local = target - vocab_start
            if local >= 0 and local < mX.shape[1]:
                z_y = Float32(mX[row, Int32(local)]) * inv_temp
            lse2, mean = self.moments(tiles, n_full, tail, inv_temp, buf)
            lse = lse2 * LN2
        if tidx == 0:
            mStats[row * STATS_COLUMNS] = lse
            mStats[row * STATS_COLUMNS + 1] = z_y
            mStats[row * STATS_COLUMNS + 2] = mean

    @cute.jit
    def moments(self, tiles: RowTiles, n_full: Int32, tail: Boolean, inv_temp: Float32, buf: cute.Tensor):
        """The pass over the row: (base-2 log-sum-exp of z, mean z under softmax), CTA-wide (slots 0-2 of buf).
        Inside, in base 2 only: u = x (log2 e / T) and t / d is the mean of u."""
        to_log2 = inv_temp * LOG2E
        m = Float32(PAD)
        d = Float32(0.0)
        t = Float32(0.0)
        for k in cutlass.range(n_full, unroll=1):
            m, d, t = softmax_moment_step(m, d, t, tiles.load(k) * to_log2)
        if tail:
            pred = tiles.predicate(n_full)
            u = cute.where(tiles.element_mask(pred), tiles.load(n_full, pred) * to_log2, tiles.full(PAD))
            m, d, t = softmax_moment_step(m, d, t, u)
        m_row, d_row = block_lse(m, d, buf, 0)
        (t_row,) = block_sum((t * cute.math.exp2(m - m_row, fastmath=True),), buf, 2)
        return m_row + cute.math.log2(d_row, fastmath=True), t_row / d_row * LN2


class LogprobsGradKernel:
    """d(g logprob + h entropy)/dx over the row under the global statistics; zeros for an ignored row."""

    def __init__(self, vec, launch, has_g, has_h):
        self.vec = vec
        self.launch = launch
        self.has_g = has_g
        self.has_h = has_h

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mStats: cute.Tensor, mG: cute.Tensor | None,
                 g_step: Int32, mH: cute.Tensor | None, h_step: Int32, vocab_start: Int64, ignore_index: Int64,
                 inv_temp: Float32, stream):
        _launch(self, mX, mTarget, mStats, mG, g_step, mH, h_step, vocab_start, ignore_index, inv_temp,
                stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mStats: cute.Tensor, mG: cute.Tensor | None,
               g_step: Int32, mH: cute.Tensor | None, h_step: Int32, vocab_start: Int64, ignore_index: Int64,
               inv_temp: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        tiles = RowTiles.of(mX, row, tidx, self.vec, self.launch)
        n_full, tail = tiles.span()
        target = mTarget[row]
        if const_expr(not self.has_g and not self.has_h):  # nothing upstream: the gradient is 0
            zero_row(tiles, n_full, tail)
        else:
            if target == ignore_index:
                zero_row(tiles, n_full, tail)
            else:
                y = Int32(target - vocab_start)  # a column of this slice, or none of them
                lse2 = mStats[row * STATS_COLUMNS] * LOG2E
                mean = mStats[row * STATS_COLUMNS + 2]
                g = Float32(0.0)
                if const_expr(self.has_g):
                    g = mG[row * g_step] * inv_temp
                h = Float32(0.0)
                if const_expr(self.has_h):
                    h = mH[row * h_step] * inv_temp
                for k in cutlass.range(n_full, unroll=1):
                    tiles.store(k, self.grad(tiles.load(k), tiles.columns(k), y, inv_temp, lse2, mean, g, h))
                if tail:
                    pred = tiles.predicate(n_full)
                    dz = self.grad(tiles.load(n_full, pred), tiles.columns(n_full), y, inv_temp, lse2, mean, g, h)
                    tiles.store(n_full, dz, pred)

    @cute.jit
    def grad(self, x: cute.TensorSSA, cols: cute.TensorSSA, y: Int32, inv_temp: Float32, lse2: Float32,
             mean: Float32, g: Float32, h: Float32):
        """dz over a tile, g and h already divided by T: g 1[j = y] - p_j (g + h (z_j - mean))."""
        z = x * inv_temp
        p = cute.math.exp2(z * LOG2E - lse2, fastmath=True)
        if const_expr(self.has_h):
            off_target = -(p * ((z - mean) * h + g))
        else:
            off_target = -(p * g)
        return cute.where(cols == y, off_target + g, off_target)


@cache
def _stats_compiled(dtype, target_dtype, vec, launch):
    syms = Syms()
    return Launcher(compile_kernel(
        LogprobsStatsKernel(vec, launch), syms.matrix(CUTE_DTYPE[dtype], vec), syms.per_row(CUTE_DTYPE[target_dtype]),
        syms.flat(), 0, -100, 1.0))


@cache
def _grad_compiled(dtype, target_dtype, vec, launch, has_g, has_h):
    syms = Syms()
    return Launcher(compile_kernel(
        LogprobsGradKernel(vec, launch, has_g, has_h), syms.matrix(CUTE_DTYPE[dtype], vec),
        syms.per_row(CUTE_DTYPE[target_dtype]), syms.flat(), syms.flat() if has_g else None, 0,
        syms.flat() if has_h else None, 0, 0, -100, 1.0))


def _limits(logits, target, *args, **kwargs):
    return row_limits(logits, target)


def _fp32(t):
    """A per-row upstream gradient as the kernels read it (fp32; the checks also let float64 through), or None."""
    return None if t is None else t.to(torch.float32)


CAPABILITY = capability(_limits)  # one for both ops: a composition of them needs them equal


@register_backend("logprobs_stats", backend="cutedsl", priority=UNTESTED_PRIORITY, capability=CAPABILITY)
def logprobs_stats(logits, target, *, vocab_start=0, temperature=1.0, ignore_index=-100):
    """[C, 3] fp32 per row of this slice: (lse, z_target where this slice holds the target else 0, mean z)."""
    stats, C, V = row_stats(logits, STATS_COLUMNS, target, ignore_index, lse_columns=(0,))
    if C and V:
        target = per_row(target)
        run = _stats_compiled(logits.dtype, target.dtype, pick_vec(V, logits), LAUNCH.current)
        run(logits, target, stats.view(-1), vocab_start, ignore_index, 1.0 / float(temperature))
    return stats


@register_backend("logprobs_grad", backend="cutedsl", priority=UNTESTED_PRIORITY, capability=CAPABILITY)
def logprobs_grad(logits, target, stats, grad_logprobs=None, grad_entropy=None, *, vocab_start=0, temperature=1.0,
                  ignore_index=-100):
    """Overwrites this slice's logits with d(sum g logprobs + h entropy)/d logits under the global stats [C, 3]."""
    C, V = logits.shape
    if C == 0 or V == 0:
        return
    target = per_row(target)
    g, g_step = scale_view(_fp32(grad_logprobs))
    h, h_step = scale_view(_fp32(grad_entropy))
    run = _grad_compiled(logits.dtype, target.dtype, pick_vec(V, logits), LAUNCH.current, g is not None,
                         h is not None)
    run(logits, target, stats.to(torch.float32).contiguous().view(-1), g, g_step, h, h_step, vocab_start,
        ignore_index, 1.0 / float(temperature))
