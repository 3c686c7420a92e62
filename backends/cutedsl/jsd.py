"""Generalized Jensen-Shannon divergence, loss and student gradient in one CuTeDSL kernel, one CTA (or
cluster, _row.py) per row.

With q = softmax(student / T), p = softmax(teacher / T) and, in base 2, lq = log2 q, lp = log2 p:
  beta = 0: KL(p||q);  dL/ds = q - p                                  -> 2 passes (gradient with the loss)
  beta = 1: KL(q||p);  dL/ds = ln2 q (lq - lp - S), S = sum q (lq - lp) -> 3 passes
  else:     beta KL(p||m) + (1-beta) KL(q||m), m = beta p + (1-beta) q;
            dL/ds = (1-beta) ln2 q (lq - lm - S), S = sum q (lq - lm)  -> 3 passes
Pass 1 finds both softmax states; the cross-column term S must be known before any gradient is stored.
The gradient w.r.t. the student logits carries 1/T and grad_scale; the teacher is only read.
"""

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

# Each row split across a cluster of CTAs (_row.py), so that later passes find the row in L2; 4096 x 128256 bf16
# chunks (benchmarks/NOTES.md): beta 0 / 1 1.09 / 1.18 ms at 8 CTAs a row against 1.27 / 1.75 with one; the mixture,
# bound by its exp2 / log2 as much as by memory, 1.66 ms at 4 (1.88 at 8, 2.02 at 1).
LAUNCH = LaunchKnobs("cutedsl jsd_loss_and_grad", RowLaunch(threads=256, unroll=2, split=8))
MIXTURE_LAUNCH = RowLaunch(threads=256, unroll=2, split=4)
FORWARD_KL, REVERSE_KL, MIXTURE = 0, 1, 2


def beta_case(beta):
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else MIXTURE


class JSDKernel:
    def __init__(self, vec, launch, case, has_scale):
        self.vec = vec
        self.case = case
        self.has_scale = has_scale
        self.launch = launch
        self.tile = launch.tile(vec)

    @cute.jit
    def __call__(self, mS: cute.Tensor, mT: cute.Tensor, mLabels: cute.Tensor | None, mLoss: cute.Tensor,
                 mScale: cute.Tensor | None, scale_step: Int32, ignore_index: Int64, beta: Float32,
                 inv_temp: Float32, stream):
        self.kernel(mS, mT, mLabels, mLoss, mScale, scale_step, ignore_index, beta, inv_temp).launch(
            **self.launch.over_rows(mS.shape[0]), stream=stream)

    @cute.jit
    def divergence(self, lq: cute.TensorSSA, lp: cute.TensorSSA, beta: Float32):
        """Per element, in base 2: (loss term / ln2, q, lq - l_ref), l_ref = lp (beta=1) or lm (mixture)."""
        q = cute.math.exp2(lq, fastmath=True)
        p = cute.math.exp2(lp, fastmath=True)
        if const_expr(self.case == FORWARD_KL):
            return p * (lp - lq), q, p
        elif const_expr(self.case == REVERSE_KL):
            diff = lq - lp
            return q * diff, q, diff
        else:
            m = beta * p + (1.0 - beta) * q
            # m below FLT_MIN only arises when p and q flushed to 0 too: the clamp keeps log2 m finite
            lm = cute.math.log2(cute.where(m > FLT_MIN, m, FLT_MIN), fastmath=True)
            diff = lq - lm
            return beta * p * (lp - lm) + (1.0 - beta) * q * diff, q, diff

    @cute.jit
    def softmax_states(self, student: RowTiles, teacher: RowTiles, n_full: Int32, tail: Boolean, to_base2: Float32,
                       red: RowReductions):
        """Pass 1 over the row: the base-2 log-sum-exp of student and teacher (times to_base2), row-wide from slots
        0-3. Loads evict-last; padding loads as 0, masked to -inf."""
        m_s = Float32(NEG_BIG)
        d_s = Float32(0.0)
        m_t = Float32(NEG_BIG)
        d_t = Float32(0.0)
        for k in cutlass.range(n_full, unroll=1):
            m_s, d_s = online_softmax_step(m_s, d_s, student.load(k, keep=True) * to_base2)
            m_t, d_t = online_softmax_step(m_t, d_t, teacher.load(k, keep=True) * to_base2)
        if tail:
            pred = student.predicate(n_full)
            mask = student.element_mask(pred)
            s2 = student.load(n_full, pred, keep=True) * to_base2
            t2 = teacher.load(n_full, pred, keep=True) * to_base2
            m_s, d_s = online_softmax_step(m_s, d_s, cute.where(mask, s2, -Float32.inf))
            m_t, d_t = online_softmax_step(m_t, d_t, cute.where(mask, t2, -Float32.inf))
        m_s, d_s = red.lse(m_s, d_s, 0)
        m_t, d_t = red.lse(m_t, d_t, 2)
        return m_s + cute.math.log2(d_s, fastmath=True), m_t + cute.math.log2(d_t, fastmath=True)

    @cute.jit
    def divergence_sums(self, student: RowTiles, teacher: RowTiles, n_full: Int32, tail: Boolean, to_base2: Float32,
                        lse_s: Float32, lse_t: Float32, beta: Float32, keep: cutlass.Constexpr[bool],
                        write_forward_grad: cutlass.Constexpr[bool], scale: Float32):
        """A pass over the row under the base-2 normalizers lse_s, lse_t: this thread's parts of the loss / ln2 and,
        for a mixture, of S / ln2 (else 0). keep: a later pass reads the row again. write_forward_grad (beta = 0):
        also writes the gradient scale * (q - p)."""
        acc_loss = Float32(0.0)
        acc_s = Float32(0.0)
        for k in cutlass.range(n_full, unroll=1):
            lq = student.load(k, keep=keep) * to_base2 - lse_s
            lp = teacher.load(k, keep=keep) * to_base2 - lse_t
            term, q, aux = self.divergence(lq, lp, beta)
            acc_loss += tile_sum(term)
            if const_expr(write_forward_grad):
                student.store(k, (q - aux) * scale)
            elif const_expr(self.case == MIXTURE):
                acc_s += tile_sum(q * aux)
        if tail:
            pred = student.predicate(n_full)
            mask = student.element_mask(pred)
            lq = student.load(n_full, pred, keep=keep) * to_base2 - lse_s
            lp = teacher.load(n_full, pred, keep=keep) * to_base2 - lse_t
            term, q, aux = self.divergence(lq, lp, beta)
            acc_loss += tile_sum(cute.where(mask, term, 0.0))
            if const_expr(write_forward_grad):
                student.store(n_full, (q - aux) * scale, pred)
            elif const_expr(self.case == MIXTURE):
                acc_s += tile_sum(cute.where(mask, q * aux, 0.0))
        return acc_loss, acc_s

    @cute.jit
    def write_grad(self, student: RowTiles, teacher: RowTiles, n_full: Int32, tail: Boolean, to_base2: Float32,
                   lse_s: Float32, lse_t: Float32, beta: Float32, cross: Float32, coef: Float32):
        """The gradient pass: coef * (q - p) for beta = 0, else coef * q * (diff - cross) (see divergence)."""
        for k in cutlass.range(n_full, unroll=1):
            lq = student.load(k) * to_base2 - lse_s
            lp = teacher.load(k) * to_base2 - lse_t
            student.store(k, self.grad(lq, lp, beta, cross, coef))
        if tail:
            pred = student.predicate(n_full)
            lq = student.load(n_full, pred) * to_base2 - lse_s
            lp = teacher.load(n_full, pred) * to_base2 - lse_t
            student.store(n_full, self.grad(lq, lp, beta, cross, coef), pred)

    @cute.jit
    def grad(self, lq: cute.TensorSSA, lp: cute.TensorSSA, beta: Float32, cross: Float32, coef: Float32):
        _, q, aux = self.divergence(lq, lp, beta)
        if const_expr(self.case == FORWARD_KL):
            return coef * (q - aux)
        return coef * q * (aux - cross)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mT: cute.Tensor, mLabels: cute.Tensor | None, mLoss: cute.Tensor,
               mScale: cute.Tensor | None, scale_step: Int32, ignore_index: Int64, beta: Float32,
               inv_temp: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        row, rank = _row.place(self.launch)
        red = RowReductions.of(self.launch, 6)
        student = RowTiles.of(mS, row, tidx, self.vec, self.launch, rank)
        teacher = RowTiles.of(mT, row, tidx, self.vec, self.launch, rank)
        n_full, tail = student.span()
        valid = _row.valid_row(mLabels, row, ignore_index)
        loss = Float32(0.0)

        if not valid:
            zero_row(student, n_full, tail)
        else:
            to_base2 = inv_temp * LOG2E
            lse_s, lse_t = self.softmax_states(student, teacher, n_full, tail, to_base2, red)

            scale = inv_temp
            if const_expr(self.has_scale):
                scale = scale * mScale[row * scale_step]

            # Pass 2: the loss and S; for beta = 0 also the gradient q - p (no cross-column term).
            forward = self.case == FORWARD_KL
            acc_loss, acc_s = self.divergence_sums(student, teacher, n_full, tail, to_base2, lse_s, lse_t, beta,
                                                   not forward, forward, scale)
            acc_loss, acc_s = red.sum((acc_loss, acc_s), 4)
            loss = acc_loss * LN2

            # Pass 3 (beta > 0): dL/ds = c ln2 q (diff - S), c = 1 - beta (mixture) or 1 (reverse KL).
            if const_expr(not forward):
                cross = acc_loss if const_expr(self.case == REVERSE_KL) else acc_s
                coef = scale * LN2
                if const_expr(self.case == MIXTURE):
                    coef = coef * (1.0 - beta)
                self.write_grad(student, teacher, n_full, tail, to_base2, lse_s, lse_t, beta, cross, coef)

        if tidx == 0 and rank == 0:
            mLoss[row] = loss
        red.done()


@cache
def _compiled(s_dtype, t_dtype, label_dtype, vec, launch, case, has_scale):
    cs, ct = CUTE_DTYPE[s_dtype], CUTE_DTYPE[t_dtype]
    syms = Syms()
    kernel = JSDKernel(vec, launch, case, has_scale)
    return Launcher(compile_kernel(
        kernel, syms.matrix(cs, vec), syms.matrix(ct, vec),
        syms.per_row(CUTE_DTYPE[label_dtype]) if label_dtype else None, syms.per_row(cutlass.Float32),
        syms.flat() if has_scale else None, 0, -100, 0.5, 1.0,
    ))


def _limits(student_logits, _other, labels=None, **_):
    return row_limits(student_logits, labels)


@register_backend("jsd_loss_and_grad", backend="cutedsl", priority=PRIORITY, capability=capability(_limits))
def jsd_loss_and_grad(student_logits, teacher_logits, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0,
                      grad_scale=None):
    """Per-row generalized JSD [C] fp32 (unscaled); student_logits overwritten with grad_scale * dloss/dstudent."""
    loss, C, V = row_losses(student_logits)
    if C == 0:
        return loss
    scale, step = scale_view(grad_scale)
    vec = pick_vec(V, student_logits, teacher_logits)
    labels = per_row(labels)
    case = beta_case(float(beta))
    launch = LAUNCH.current_or(MIXTURE_LAUNCH if case == MIXTURE else LAUNCH.default)
    run = _compiled(student_logits.dtype, teacher_logits.dtype, labels.dtype if labels is not None else None, vec,
                    launch, case, scale is not None)
    run(student_logits, teacher_logits, labels, loss, scale, step, ignore_index, float(beta), 1.0 / float(temperature))
    return loss
