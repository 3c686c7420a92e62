"""Vocab-parallel CE, JSD and KL as CuTeDSL kernels: per-row statistics of this rank's vocabulary
slice, and the gradient pass that takes the statistics combined over ranks. One CTA per row, as ce.py / jsd.py /
kl_div.py, each kernel one of their row passes:
    ce:     stats  = CrossEntropyKernel.softmax_state (+ the target's logit where this slice owns it)
            grad   = CrossEntropyKernel.write_grad under the global statistics, the target as a local column
    jsd:    stats  = JSDKernel.softmax_states;  sums = JSDKernel.divergence_sums under the global lse pair
            grad   = JSDKernel.write_grad with the global S
    kl_div: stats  = KLDivKernel.statistics;    grad = KLDivKernel.write_grad with the global lse and sum q
Statistics and sums passes load evict-last (the gradient pass reads the row again after the all-reduce). Statistics are
fp32 and natural-log; a [C, k] output is written through a flat view, row r's column j at r * k + j. Per-row
inputs of one column take any stride (their flat view and row step, as grad_scale); [C, 2] ones are made
contiguous. Ignored rows are never read: zero statistics, zero gradient.
"""

import dataclasses

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._vp_rows import row_stats
from . import _row, ce, jsd, kl_div
from ._row import FLT_MIN, LN2, LOG2E, RowReductions, RowTiles, zero_row
from ._support import (CUTE_DTYPE, Launcher, Syms, cache, capability, compile_kernel, per_row,
                       pick_vec, row_limits, scale_view)
from .jsd import FORWARD_KL, MIXTURE, REVERSE_KL, beta_case

# After triton (20), before helion (30): these kernels compile for sm_90a and pass TVM-FFI's argument checks on the
# CPU but have not run on a GPU yet, so auto selection takes Triton's; backend="cutedsl" or LIGER_BACKEND picks them.
VP_PRIORITY = 25

# the row-kernel knobs of each family's vocab-parallel kernels, by default those of its single-vocabulary kernel
# A CTA per row (these kernels do not split rows across a cluster)
CE_LAUNCH = LaunchKnobs("cutedsl ce vocab-parallel ops", ce.COMPUTE_BOUND_LAUNCH)
JSD_LAUNCH = LaunchKnobs("cutedsl jsd vocab-parallel ops", dataclasses.replace(jsd.LAUNCH.default, split=1))
KL_DIV_LAUNCH = LaunchKnobs("cutedsl kl_div vocab-parallel ops", dataclasses.replace(kl_div.LAUNCH.default, split=1))


def _launch(kernel, mX, *args, stream):
    """One CTA per row of mX."""
    kernel.kernel(mX, *args).launch(grid=[mX.shape[0], 1, 1], block=[kernel.launch.threads, 1, 1], stream=stream)


# ---------------------------------------------------------------- cross-entropy


class CEStatsKernel(ce.CrossEntropyKernel):
    """(lse, max z, z_target if owned here else 0, sum w z, sum w) per row; mWeightRow [1, Vl]: the slice's
    class weights, or None (w = 1)."""

    def __init__(self, vec, launch, has_softcap, has_weight):
        super().__init__(vec, launch, has_scale=False, has_softcap=has_softcap, has_smoothing=True,
                         has_weight=has_weight, has_stats=True)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mWeightRow: cute.Tensor | None, mStats: cute.Tensor,
                 vocab_start: Int64, ignore_index: Int64, softcap: Float32, stream):
        _launch(self, mX, mTarget, mWeightRow, mStats, vocab_start, ignore_index, softcap, stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mWeightRow: cute.Tensor | None, mStats: cute.Tensor,
               vocab_start: Int64, ignore_index: Int64, softcap: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        red = RowReductions.of(self.launch, 5)
        tiles = RowTiles.of(mX, row, tidx, self.vec, self.launch)
        weights = self.weight_tiles(mWeightRow, tidx, None)
        n_full, tail = tiles.span()
        target = mTarget[row]
        lse = Float32(0.0)
        z_max = Float32(0.0)
        z_y = Float32(0.0)
        z_sum = Float32(0.0)
        w_sum = Float32(0.0)
        if target != ignore_index:
            local = target - vocab_start
            if local >= 0 and local < mX.shape[1]:
                z_y = self.logits(Float32(mX[row, Int32(local)]), softcap)[0]
            lse2, z_sum, w_sum, z_max = self.softmax_state(tiles, weights, n_full, tail, softcap, red)
            z_sum, w_sum = red.sum((z_sum, w_sum), 2)
            z_max = red.max(z_max, 4)
            if const_expr(not self.has_weight):
                w_sum = Float32(mX.shape[1])
            lse = lse2 * LN2
        if tidx == 0:
            for j, value in enumerate((lse, z_max, z_y, z_sum, w_sum)):
                mStats[row * 5 + j] = value


class CEGradKernel(ce.CrossEntropyKernel):
    """grad_scale * (((1 - eps) w_y + eps W / V + 2 s lse) softmax_j - (1 - eps) w_y [j == y] - eps w_j / V) * dz/dx
    under the global statistics (mStats [C * 5], ce_vp_stats' columns); mWeights: the whole vocabulary's class
    weights (w_y), mWeightRow [1, Vl] this slice's (w_j, when smoothing reads them), or None."""

    def __init__(self, vec, launch, has_scale, has_softcap, has_weight):
        super().__init__(vec, launch, has_scale=has_scale, has_softcap=has_softcap, has_smoothing=False,
                         has_weight=has_weight)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mStats: cute.Tensor, mScale: cute.Tensor | None,
                 scale_step: Int32, mWeights: cute.Tensor | None, mWeightRow: cute.Tensor | None, vocab_start: Int64,
                 ignore_index: Int64, smoothing: Float32, inv_vocab: Float32, lse_square_scale: Float32,
                 softcap: Float32, stream):
        _launch(self, mX, mTarget, mStats, mScale, scale_step, mWeights, mWeightRow, vocab_start, ignore_index,
                smoothing, inv_vocab, lse_square_scale, softcap, stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mStats: cute.Tensor, mScale: cute.Tensor | None,
               scale_step: Int32, mWeights: cute.Tensor | None, mWeightRow: cute.Tensor | None, vocab_start: Int64,
               ignore_index: Int64, smoothing: Float32, inv_vocab: Float32, lse_square_scale: Float32,
               softcap: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        tiles = RowTiles.of(mX, row, tidx, self.vec, self.launch)
        weights = self.weight_tiles(mWeightRow, tidx, None)
        n_full, tail = tiles.span()
        target = mTarget[row]
        if target == ignore_index:
            zero_row(tiles, n_full, tail)
        else:
            y = Int32(target - vocab_start)  # a column of this slice, or none of them
            lse = mStats[row * 5]
            weight_mean = Float32(1.0)
            if const_expr(self.has_weight):
                weight_mean = mStats[row * 5 + 4] * inv_vocab
            scale = Float32(1.0)
            if const_expr(self.has_scale):
                scale = mScale[row * scale_step]
            p_coef, uniform, on_target = ce.coefficients(scale, smoothing, inv_vocab,
                                                         self.target_weight(mWeights, target), weight_mean, lse,
                                                         lse_square_scale)
            self.write_grad(tiles, weights, n_full, tail, y, softcap, lse * LOG2E, p_coef, uniform, on_target)


# ---------------------------------------------------------------- JSD


class JSDStatsKernel(jsd.JSDKernel):
    """(lse of student / T, lse of teacher / T) per row."""

    def __init__(self, vec, launch):
        super().__init__(vec, launch, case=MIXTURE, has_scale=False)  # the case plays no part

    @cute.jit
    def __call__(self, mS: cute.Tensor, mT: cute.Tensor, mLabels: cute.Tensor | None, mStats: cute.Tensor,
                 ignore_index: Int64, inv_temp: Float32, stream):
        _launch(self, mS, mT, mLabels, mStats, ignore_index, inv_temp, stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mT: cute.Tensor, mLabels: cute.Tensor | None, mStats: cute.Tensor,
               ignore_index: Int64, inv_temp: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        red = RowReductions.of(self.launch, 4)
        student = RowTiles.of(mS, row, tidx, self.vec, self.launch)
        teacher = RowTiles.of(mT, row, tidx, self.vec, self.launch)
        n_full, tail = student.span()
        lse_s = Float32(0.0)
        lse_t = Float32(0.0)
        if _row.valid_row(mLabels, row, ignore_index):
            lse_s, lse_t = self.softmax_states(student, teacher, n_full, tail, inv_temp * LOG2E, red)
            lse_s, lse_t = lse_s * LN2, lse_t * LN2
        if tidx == 0:
            mStats[row * 2] = lse_s
            mStats[row * 2 + 1] = lse_t


class JSDSumsKernel(jsd.JSDKernel):
    """(this slice's part of the row loss, of S) per row under the global lse pair."""

    def __init__(self, vec, launch, case):
        super().__init__(vec, launch, case=case, has_scale=False)

    @cute.jit
    def __call__(self, mS: cute.Tensor, mT: cute.Tensor, mLabels: cute.Tensor | None, mLse: cute.Tensor,
                 mSums: cute.Tensor, ignore_index: Int64, beta: Float32, inv_temp: Float32, stream):
        _launch(self, mS, mT, mLabels, mLse, mSums, ignore_index, beta, inv_temp, stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mT: cute.Tensor, mLabels: cute.Tensor | None, mLse: cute.Tensor,
               mSums: cute.Tensor, ignore_index: Int64, beta: Float32, inv_temp: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        red = RowReductions.of(self.launch, 2)
        student = RowTiles.of(mS, row, tidx, self.vec, self.launch)
        teacher = RowTiles.of(mT, row, tidx, self.vec, self.launch)
        n_full, tail = student.span()
        loss = Float32(0.0)
        cross = Float32(0.0)
        if _row.valid_row(mLabels, row, ignore_index):
            acc_loss, acc_s = self.divergence_sums(
                student, teacher, n_full, tail, inv_temp * LOG2E, mLse[row * 2] * LOG2E, mLse[row * 2 + 1] * LOG2E,
                beta, True, False, Float32(0.0))
            acc_loss, acc_s = red.sum((acc_loss, acc_s), 0)
            loss = acc_loss * LN2
            if const_expr(self.case == REVERSE_KL):
                cross = loss
            elif const_expr(self.case == MIXTURE):
                cross = acc_s * LN2
        if tidx == 0:
            mSums[row * 2] = loss
            mSums[row * 2 + 1] = cross


class JSDGradKernel(jsd.JSDKernel):
    """grad_scale / T * dloss/ds under the global lse pair and S."""

    @cute.jit
    def __call__(self, mS: cute.Tensor, mT: cute.Tensor, mLabels: cute.Tensor | None, mLse: cute.Tensor,
                 mSums: cute.Tensor, mScale: cute.Tensor | None, scale_step: Int32, ignore_index: Int64,
                 beta: Float32, inv_temp: Float32, stream):
        _launch(self, mS, mT, mLabels, mLse, mSums, mScale, scale_step, ignore_index, beta, inv_temp, stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mT: cute.Tensor, mLabels: cute.Tensor | None, mLse: cute.Tensor,
               mSums: cute.Tensor, mScale: cute.Tensor | None, scale_step: Int32, ignore_index: Int64,
               beta: Float32, inv_temp: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        student = RowTiles.of(mS, row, tidx, self.vec, self.launch)
        teacher = RowTiles.of(mT, row, tidx, self.vec, self.launch)
        n_full, tail = student.span()
        if not _row.valid_row(mLabels, row, ignore_index):
            zero_row(student, n_full, tail)
        else:
            coef = inv_temp
            if const_expr(self.has_scale):
                coef = coef * mScale[row * scale_step]
            if const_expr(self.case != FORWARD_KL):
                coef = coef * LN2
            if const_expr(self.case == MIXTURE):
                coef = coef * (1.0 - beta)
            self.write_grad(student, teacher, n_full, tail, inv_temp * LOG2E, mLse[row * 2] * LOG2E,
                            mLse[row * 2 + 1] * LOG2E, beta, mSums[row * 2 + 1] * LOG2E, coef)


# ---------------------------------------------------------------- KL divergence


class KLDivStatsKernel(kl_div.KLDivKernel):
    """(lse of student / T, sum q, sum q log q, sum q s) per row."""

    def __init__(self, vec, launch, log_target):
        super().__init__(vec, launch, log_target, has_scale=False)

    @cute.jit
    def __call__(self, mS: cute.Tensor, mTarget: cute.Tensor, mLabels: cute.Tensor | None, mStats: cute.Tensor,
                 ignore_index: Int64, inv_temp: Float32, eps: Float32, stream):
        _launch(self, mS, mTarget, mLabels, mStats, ignore_index, inv_temp, eps, stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mTarget: cute.Tensor, mLabels: cute.Tensor | None, mStats: cute.Tensor,
               ignore_index: Int64, inv_temp: Float32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        red = RowReductions.of(self.launch, 5)
        student = RowTiles.of(mS, row, tidx, self.vec, self.launch)
        target = RowTiles.of(mTarget, row, tidx, self.vec, self.launch)
        n_full, tail = student.span()
        lse = Float32(0.0)
        q_log_q = Float32(0.0)
        q_s = Float32(0.0)
        q_sum = Float32(0.0)
        if _row.valid_row(mLabels, row, ignore_index):
            lse2, q_log_q, q_s, q_sum = self.statistics(student, target, n_full, tail, inv_temp, eps, red)
            lse = lse2 * LN2
        if tidx == 0:
            mStats[row * 4] = lse
            mStats[row * 4 + 1] = q_sum
            mStats[row * 4 + 2] = q_log_q
            mStats[row * 4 + 3] = q_s


class KLDivGradKernel(kl_div.KLDivKernel):
    """grad_scale / T * (softmax_j * target_sum - q_j) under the global lse."""

    @cute.jit
    def __call__(self, mS: cute.Tensor, mTarget: cute.Tensor, mLabels: cute.Tensor | None, mLse: cute.Tensor,
                 lse_step: Int32, mTotal: cute.Tensor, total_step: Int32, mScale: cute.Tensor | None,
                 scale_step: Int32, ignore_index: Int64, inv_temp: Float32, stream):
        _launch(self, mS, mTarget, mLabels, mLse, lse_step, mTotal, total_step, mScale, scale_step, ignore_index,
                inv_temp, stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mTarget: cute.Tensor, mLabels: cute.Tensor | None, mLse: cute.Tensor,
               lse_step: Int32, mTotal: cute.Tensor, total_step: Int32, mScale: cute.Tensor | None,
               scale_step: Int32, ignore_index: Int64, inv_temp: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        student = RowTiles.of(mS, row, tidx, self.vec, self.launch)
        target = RowTiles.of(mTarget, row, tidx, self.vec, self.launch)
        n_full, tail = student.span()
        if not _row.valid_row(mLabels, row, ignore_index):
            zero_row(student, n_full, tail)
        else:
            scale = inv_temp
            if const_expr(self.has_scale):
                scale = scale * mScale[row * scale_step]
            # eps only shapes q log q, which the gradient does not use
            self.write_grad(student, target, n_full, tail, inv_temp, Float32(FLT_MIN),
                            mLse[row * lse_step] * LOG2E, scale * mTotal[row * total_step], scale)


# ---------------------------------------------------------------- compiled kernels


def _labels(syms, label_dtype):
    return syms.per_row(CUTE_DTYPE[label_dtype]) if label_dtype else None


@cache
def _ce_stats(dtype, target_dtype, vec, launch, has_softcap, has_weight):
    syms = Syms()
    return Launcher(compile_kernel(
        CEStatsKernel(vec, launch, has_softcap, has_weight), syms.matrix(CUTE_DTYPE[dtype], vec),
        syms.per_row(CUTE_DTYPE[target_dtype]), syms.row_vector(Float32, vec) if has_weight else None, syms.flat(),
        0, -100, 1.0))


@cache
def _ce_grad(dtype, target_dtype, vec, launch, has_scale, has_softcap, has_weight, per_column):
    syms = Syms()
    return Launcher(compile_kernel(
        CEGradKernel(vec, launch, has_scale, has_softcap, has_weight), syms.matrix(CUTE_DTYPE[dtype], vec),
        syms.per_row(CUTE_DTYPE[target_dtype]), syms.flat(), syms.flat() if has_scale else None, 0,
        syms.flat() if has_weight else None, syms.row_vector(Float32, vec) if per_column else None, 0, -100,
        0.0, 0.0, 0.0, 1.0))


@cache
def _jsd_stats(s_dtype, t_dtype, label_dtype, vec, launch):
    syms = Syms()
    return Launcher(compile_kernel(
        JSDStatsKernel(vec, launch), syms.matrix(CUTE_DTYPE[s_dtype], vec), syms.matrix(CUTE_DTYPE[t_dtype], vec),
        _labels(syms, label_dtype), syms.flat(), -100, 1.0))


@cache
def _jsd_sums(s_dtype, t_dtype, label_dtype, vec, launch, case):
    syms = Syms()
    return Launcher(compile_kernel(
        JSDSumsKernel(vec, launch, case), syms.matrix(CUTE_DTYPE[s_dtype], vec),
        syms.matrix(CUTE_DTYPE[t_dtype], vec), _labels(syms, label_dtype), syms.flat(), syms.flat(), -100, 0.5, 1.0))


@cache
def _jsd_grad(s_dtype, t_dtype, label_dtype, vec, launch, case, has_scale):
    syms = Syms()
    return Launcher(compile_kernel(
        JSDGradKernel(vec, launch, case, has_scale), syms.matrix(CUTE_DTYPE[s_dtype], vec),
        syms.matrix(CUTE_DTYPE[t_dtype], vec), _labels(syms, label_dtype), syms.flat(), syms.flat(),
        syms.flat() if has_scale else None, 0, -100, 0.5, 1.0))


@cache
def _kl_div_stats(s_dtype, t_dtype, label_dtype, vec, launch, log_target):
    syms = Syms()
    return Launcher(compile_kernel(
        KLDivStatsKernel(vec, launch, log_target), syms.matrix(CUTE_DTYPE[s_dtype], vec),
        syms.matrix(CUTE_DTYPE[t_dtype], vec), _labels(syms, label_dtype), syms.flat(), -100, 1.0, 1e-10))


@cache
def _kl_div_grad(s_dtype, t_dtype, label_dtype, vec, launch, log_target, has_scale):
    syms = Syms()
    return Launcher(compile_kernel(
        KLDivGradKernel(vec, launch, log_target, has_scale), syms.matrix(CUTE_DTYPE[s_dtype], vec),
        syms.matrix(CUTE_DTYPE[t_dtype], vec), _labels(syms, label_dtype), syms.flat(), 1, syms.flat(), 1,
        syms.flat() if has_scale else None, 0, -100, 1.0))


# ---------------------------------------------------------------- registered ops


def _limits(logits, *args, **kwargs):
    """row_limits of the slice and of the call's per-row class indices or labels (its one integer tensor)."""
    index = [a for a in (*args, *kwargs.values()) if hasattr(a, "dtype") and not a.dtype.is_floating_point]
    return row_limits(logits, index[0] if index else None)


CAPABILITY = capability(_limits)  # one for all seven ops: a composition of them needs them equal


def _pairs(t):
    """A [C, 2] fp32 input as the kernels read it: flat, row r's pair at 2r, 2r + 1."""
    return t.contiguous().view(-1)


def _label_dtype(labels):
    return None if labels is None else labels.dtype


@register_backend("ce_vp_stats", backend="cutedsl", priority=VP_PRIORITY, capability=CAPABILITY)
def ce_vp_stats(logits, target, *, vocab_start=0, ignore_index=-100, softcap=None, ce_weight=None):
    """[C, 5] fp32 per row of this slice: (lse, max z, z_target where this slice owns the target else 0, sum w z,
    sum w)."""
    stats, C, V = row_stats(logits, 5, target, ignore_index, lse_columns=(0, 1))
    if C and V:
        target = per_row(target)
        _, weight_row = ce.weight_views(ce_weight, vocab_start, V, True)
        vec = pick_vec(V, logits, *(() if weight_row is None else (weight_row,)))
        run = _ce_stats(logits.dtype, target.dtype, vec, CE_LAUNCH.current, softcap is not None,
                        ce_weight is not None)
        run(logits, target, weight_row, stats.view(-1), vocab_start, ignore_index,
            1.0 if softcap is None else float(softcap))
    return stats


@register_backend("ce_vp_grad", backend="cutedsl", priority=VP_PRIORITY, capability=CAPABILITY)
def ce_vp_grad(logits, target, stats, *, vocab_start=0, vocab_size=0, grad_scale=None, ignore_index=-100,
               label_smoothing=0.0, softcap=None, lse_square_scale=0.0, ce_weight=None):
    """Overwrites this slice's logits with grad_scale * dloss/dlogits under the global statistics [C, 5]."""
    C, V = logits.shape
    if C == 0 or V == 0:
        return
    target = per_row(target)
    scale, step = scale_view(grad_scale)
    weights, weight_row = ce.weight_views(ce_weight, vocab_start, V, label_smoothing != 0.0)
    vec = pick_vec(V, logits, *(() if weight_row is None else (weight_row,)))
    run = _ce_grad(logits.dtype, target.dtype, vec, CE_LAUNCH.current, scale is not None, softcap is not None,
                   weights is not None, weight_row is not None)
    run(logits, target, stats.contiguous().view(-1), scale, step, weights, weight_row, vocab_start, ignore_index,
        float(label_smoothing), 1.0 / (vocab_size or V), float(lse_square_scale),
        1.0 if softcap is None else float(softcap))


@register_backend("jsd_vp_stats", backend="cutedsl", priority=VP_PRIORITY, capability=CAPABILITY)
def jsd_vp_stats(student_logits, teacher_logits, labels=None, *, ignore_index=-100, temperature=1.0):
    """[C, 2] fp32 per row of this slice: lse of student / T and of teacher / T."""
    stats, C, V = row_stats(student_logits, 2, labels, ignore_index, lse_columns=(0, 1))
    if C and V:
        labels = per_row(labels)
        run = _jsd_stats(student_logits.dtype, teacher_logits.dtype, _label_dtype(labels),
                         pick_vec(V, student_logits, teacher_logits), JSD_LAUNCH.current)
        run(student_logits, teacher_logits, labels, stats.view(-1), ignore_index, 1.0 / float(temperature))
    return stats


@register_backend("jsd_vp_sums", backend="cutedsl", priority=VP_PRIORITY, capability=CAPABILITY)
def jsd_vp_sums(student_logits, teacher_logits, lse, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0):
    """[C, 2] fp32 per row: this slice's part of the row loss and of S, under the global lse [C, 2]."""
    sums, C, V = row_stats(student_logits, 2)
    if not (C and V):
        return sums
    labels = per_row(labels)
    run = _jsd_sums(student_logits.dtype, teacher_logits.dtype, _label_dtype(labels),
                    pick_vec(V, student_logits, teacher_logits), JSD_LAUNCH.current, beta_case(float(beta)))
    run(student_logits, teacher_logits, labels, _pairs(lse), sums.view(-1), ignore_index, float(beta),
        1.0 / float(temperature))
    return sums


@register_backend("jsd_vp_grad", backend="cutedsl", priority=VP_PRIORITY, capability=CAPABILITY)
def jsd_vp_grad(student_logits, teacher_logits, lse, sums, labels=None, *, beta=0.5, ignore_index=-100,
                temperature=1.0, grad_scale=None):
    """Overwrites this slice's student logits with grad_scale * dloss/dlogits under the global lse and sums."""
    C, V = student_logits.shape
    if C == 0 or V == 0:
        return
    labels = per_row(labels)
    scale, step = scale_view(grad_scale)
    run = _jsd_grad(student_logits.dtype, teacher_logits.dtype, _label_dtype(labels),
                    pick_vec(V, student_logits, teacher_logits), JSD_LAUNCH.current, beta_case(float(beta)),
                    scale is not None)
    run(student_logits, teacher_logits, labels, _pairs(lse), _pairs(sums), scale, step, ignore_index, float(beta),
        1.0 / float(temperature))


@register_backend("kl_div_vp_stats", backend="cutedsl", priority=VP_PRIORITY, capability=CAPABILITY)
def kl_div_vp_stats(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                    log_target=False):
    """[C, 4] fp32 per row of this slice: (lse of s = student / T, sum q, sum q log q, sum q s)."""
    stats, C, V = row_stats(student_logits, 4, labels, ignore_index, lse_columns=(0,))
    if C and V:
        labels = per_row(labels)
        run = _kl_div_stats(student_logits.dtype, target.dtype, _label_dtype(labels),
                            pick_vec(V, student_logits, target), KL_DIV_LAUNCH.current, bool(log_target))
        run(student_logits, target, labels, stats.view(-1), ignore_index, 1.0 / float(temperature),
            max(float(eps), FLT_MIN))
    return stats


@register_backend("kl_div_vp_grad", backend="cutedsl", priority=VP_PRIORITY, capability=CAPABILITY)
def kl_div_vp_grad(student_logits, target, lse, target_sum, labels=None, *, ignore_index=-100, temperature=1.0,
                   log_target=False, grad_scale=None):
    """Overwrites this slice's student logits with grad_scale / T * (softmax_j * target_sum - q_j)."""
    C, V = student_logits.shape
    if C == 0 or V == 0:
        return
    labels = per_row(labels)
    scale, step = scale_view(grad_scale)
    lse, lse_step = scale_view(lse)
    total, total_step = scale_view(target_sum)
    run = _kl_div_grad(student_logits.dtype, target.dtype, _label_dtype(labels), pick_vec(V, student_logits, target),
                       KL_DIV_LAUNCH.current, bool(log_target), scale is not None)
    run(student_logits, target, labels, lse, lse_step, total, total_step, scale, step, ignore_index,
        1.0 / float(temperature))
