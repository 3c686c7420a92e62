"""KL(target || softmax(student / T)) per row, loss and student gradient in one CuTeDSL kernel, one CTA (or
cluster, _row.py) per row.

loss = sum_j q_j (log q_j - s_j + lse) = A - B + lse * Q with A = sum q log q (0 log 0 = 0), B = sum q s,
Q = sum q: none of A, B, Q needs lse, so pass 1 gathers them beside the softmax state and pass 2 writes
dL/ds_j = softmax_j * Q - q_j (times 1/T and grad_scale) over the student logits.

Targets (benchmarks/kl_semantics.md): 0 log 0 = 0 (also a log-target of -inf), a negative probability makes the
row's loss NaN (torch's kl_div: NaN) with the gradient softmax * Q - q as torch's, log-targets may be unnormalized.
Not run on a GPU since these changes (precise_exp, the NaN), only compiled for sm_90a. Known precision gaps against
torch fp32, not fixed here: the loss A - B + lse Q cancels between terms of size Q |lse| when the KL is small, and
the softmax is scaled to base 2 before the max is subtracted (backends/triton/kl_div.py, shifted_softmax_step).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, const_expr

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._rows import row_losses
from . import _row
from ._row import (FLT_MIN, LN2, LOG2E, NEG_BIG, RowLaunch, RowReductions, RowTiles, online_softmax_step, tile_sum,
                   zero_row)
from ._support import (PRIORITY, CUTE_DTYPE, Launcher, Syms, cache, capability, compile_kernel, per_row,
                       pick_vec, row_limits, scale_view)

# Each row split across a cluster of 8 CTAs (_row.py), so that pass 2 finds the row in L2: 0.993 ms a 4096 x 128256
# bf16 chunk against 1.271 with a CTA per row (benchmarks/NOTES.md).
LAUNCH = LaunchKnobs("cutedsl kl_div_loss_and_grad", RowLaunch(threads=256, unroll=2, split=8))
LN2_HI = 0.693145751953125  # ln 2 to 12 significant bits: n * LN2_HI is exact for |n| < 2^12
LN2_LO = 1.4286068203094173e-06  # ln 2 - LN2_HI


@cute.jit
def precise_exp(x: cute.TensorSSA):
    """e^x to about an ulp (Cody-Waite, as backends/triton/kl_div.py): 2^n * 2^(r log2 e), n = round(x log2 e) in
    [-126, 127], r = x - n ln 2. exp2(x * log2 e) rounds the product: 2^-24 |x log2 e| in the exponent, 7 ulps of
    e^x at |x| = 12, which unnormalized log-targets pass on to the loss and the gradient. -inf gives 0."""
    y = x * LOG2E
    n = cute.math.roundeven(cute.where(y < -126.0, -126.0, cute.where(y > 127.0, 127.0, y)))
    r = (x - n * LN2_HI) - n * LN2_LO
    return cute.math.exp2(n, fastmath=True) * cute.math.exp2(r * LOG2E, fastmath=True)


class KLDivKernel:
    def __init__(self, vec, launch, log_target, has_scale):
        self.vec = vec
        self.log_target = log_target
        self.has_scale = has_scale
        self.launch = launch
        self.tile = launch.tile(vec)
        # Padding must read as q = 0: probability 0, or log-probability -inf.
        self.target_fill = -float("inf") if log_target else 0.0

    @cute.jit
    def __call__(self, mS: cute.Tensor, mTarget: cute.Tensor, mLabels: cute.Tensor | None, mLoss: cute.Tensor,
                 mScale: cute.Tensor | None, scale_step: Int32, ignore_index: Int64, inv_temp: Float32,
                 eps: Float32, stream):
        self.kernel(mS, mTarget, mLabels, mLoss, mScale, scale_step, ignore_index, inv_temp, eps).launch(
            **self.launch.over_rows(mS.shape[0]), stream=stream)

    @cute.jit
    def target(self, t: cute.TensorSSA, eps: Float32):
        """(q, q log q) per element, natural log, q log q = 0 where q = 0; NaN for a negative probability (its row's
        loss is NaN, as torch's kl_div; q, and so the gradient, stays as given). A log-target's q = e^t to about an
        ulp (precise_exp), -inf gives q = 0."""
        if const_expr(self.log_target):
            q = precise_exp(t)
            return q, cute.where(q != 0.0, q * t, 0.0)
        log_q = cute.math.log2(cute.where(t > eps, t, eps), fastmath=True) * LN2
        return t, cute.where(t < 0.0, math.nan, t * log_q)

    @cute.jit
    def statistics(self, student: RowTiles, target: RowTiles, n_full: Int32, tail: Boolean, inv_temp: Float32,
                   eps: Float32, red: RowReductions):
        """Pass 1 over the row, row-wide (slots 0-4): the base-2 log-sum-exp of s = student / T, A, B, Q.

        Loads evict-last; padding has q = 0, s = 0."""
        m = Float32(NEG_BIG)
        d = Float32(0.0)
        acc_qlogq = Float32(0.0)
        acc_qs = Float32(0.0)
        acc_q = Float32(0.0)
        for k in cutlass.range(n_full, unroll=1):
            s = student.load(k, keep=True) * inv_temp
            q, q_log_q = self.target(target.load(k, keep=True), eps)
            m, d = online_softmax_step(m, d, s * LOG2E)
            acc_qlogq += tile_sum(q_log_q)
            acc_qs += tile_sum(q * s)
            acc_q += tile_sum(q)
        if tail:
            pred = student.predicate(n_full)
            s = student.load(n_full, pred, keep=True) * inv_temp
            q, q_log_q = self.target(target.load(n_full, pred, self.target_fill, keep=True), eps)
            m, d = online_softmax_step(m, d, cute.where(student.element_mask(pred), s * LOG2E, -Float32.inf))
            acc_qlogq += tile_sum(q_log_q)
            acc_qs += tile_sum(q * s)
            acc_q += tile_sum(q)
        m, d = red.lse(m, d, 0)
        acc_qlogq, acc_qs, acc_q = red.sum((acc_qlogq, acc_qs, acc_q), 2)
        return m + cute.math.log2(d, fastmath=True), acc_qlogq, acc_qs, acc_q

    @cute.jit
    def write_grad(self, student: RowTiles, target: RowTiles, n_full: Int32, tail: Boolean, inv_temp: Float32,
                   eps: Float32, lse2: Float32, p_coef: Float32, scale: Float32):
        """The gradient pass: p_coef * softmax_j - scale * q_j over the row, softmax under the base-2 lse2."""
        to_base2 = inv_temp * LOG2E
        for k in cutlass.range(n_full, unroll=1):
            q, _ = self.target(target.load(k), eps)
            p = cute.math.exp2(student.load(k) * to_base2 - lse2, fastmath=True)
            student.store(k, p_coef * p - scale * q)
        if tail:
            pred = student.predicate(n_full)
            q, _ = self.target(target.load(n_full, pred, self.target_fill), eps)
            p = cute.math.exp2(student.load(n_full, pred) * to_base2 - lse2, fastmath=True)
            student.store(n_full, p_coef * p - scale * q, pred)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mTarget: cute.Tensor, mLabels: cute.Tensor | None, mLoss: cute.Tensor,
               mScale: cute.Tensor | None, scale_step: Int32, ignore_index: Int64, inv_temp: Float32,
               eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, rank = _row.place(self.launch)
        red = RowReductions.of(self.launch, 5)
        student = RowTiles.of(mS, row, tidx, self.vec, self.launch, rank)
        target = RowTiles.of(mTarget, row, tidx, self.vec, self.launch, rank)
        n_full, tail = student.span()
        valid = _row.valid_row(mLabels, row, ignore_index)
        loss = Float32(0.0)

        if not valid:
            zero_row(student, n_full, tail)
        else:
            lse2, acc_qlogq, acc_qs, acc_q = self.statistics(student, target, n_full, tail, inv_temp, eps, red)
            loss = acc_qlogq - acc_qs + lse2 * LN2 * acc_q

            # Pass 2: dL/ds_j = softmax_j * Q - q_j, times 1/T and grad_scale.
            scale = inv_temp
            if const_expr(self.has_scale):
                scale = scale * mScale[row * scale_step]
            self.write_grad(student, target, n_full, tail, inv_temp, eps, lse2, scale * acc_q, scale)

        if tidx == 0 and rank == 0:
            mLoss[row] = loss
        red.done()


@cache
def _compiled(s_dtype, t_dtype, label_dtype, vec, launch, log_target, has_scale):
    cs, ct = CUTE_DTYPE[s_dtype], CUTE_DTYPE[t_dtype]
    syms = Syms()
    kernel = KLDivKernel(vec, launch, log_target, has_scale)
    return Launcher(compile_kernel(
        kernel, syms.matrix(cs, vec), syms.matrix(ct, vec),
        syms.per_row(CUTE_DTYPE[label_dtype]) if label_dtype else None, syms.per_row(cutlass.Float32),
        syms.flat() if has_scale else None, 0, -100, 1.0, 1e-10,
    ))


def _limits(student_logits, _other, labels=None, **_):
    return row_limits(student_logits, labels)


@register_backend("kl_div_loss_and_grad", backend="cutedsl", priority=PRIORITY, capability=capability(_limits))
def kl_div_loss_and_grad(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                         log_target=False, grad_scale=None):
    """Per-row KL(target || softmax(student / T)) [C] fp32 (unscaled); student_logits overwritten with its gradient."""
    loss, C, V = row_losses(student_logits)
    if C == 0:
        return loss
    scale, step = scale_view(grad_scale)
    vec = pick_vec(V, student_logits, target)
    labels = per_row(labels)
    run = _compiled(student_logits.dtype, target.dtype, labels.dtype if labels is not None else None, vec,
                    LAUNCH.current, bool(log_target), scale is not None)
    run(student_logits, target, labels, loss, scale, step, ignore_index, 1.0 / float(temperature),
        max(float(eps), FLT_MIN))  # log max(q, eps) stays finite: q = 0 gives 0 * finite = 0, also for eps = 0
    return loss
