"""Generalized Jensen-Shannon divergence between a student's and a teacher's LM heads, for distillation: the
user-level `fused_linear_jsd` and the kernel-level ops it is composed of.

    fused_linear_jsd(student_input [..., H], student_weight [V, H], teacher_input, teacher_weight, shift_labels?)
    jsd_loss_and_grad(student_logits [C, V], teacher_logits [C, V], labels?) -> loss rows; student logits overwritten
    jsd_vp_stats / jsd_vp_sums / jsd_vp_grad: the same over one rank's vocabulary slice (vocab-parallel)

s = student logits / T, t = teacher logits / T, q = softmax(s), p = softmax(t). beta = 0: KL(p || q); beta = 1:
KL(q || p); otherwise with m = beta p + (1 - beta) q: beta KL(p || m) + (1 - beta) KL(q || m). Mean over the
non-ignored rows, times T^2 when asked; the teacher is never differentiated. Vocab-parallel: per row, the slice's
(lse of s, lse of t), combined by log-sum-exp; then the slice's (loss, cross term), summed over the ranks.
"""

from __future__ import annotations

import math

import torch

from liger_dispatch.compose import fused_linear as fl
from liger_dispatch.compose.grad_bounds import Bound, logit_bound
from liger_dispatch.compose.vocab_parallel import VocabParallel, VocabShard
from liger_dispatch.core.table import OpSpec
from liger_dispatch.registry import checks as c
from liger_dispatch.registry import heads
from liger_dispatch.registry.cases import (FP16, Case, Inputs, beyond_fp16_head, empty_head, empty_leaves,
                                           non_contiguous, overflow_head, sample_labels)
from liger_dispatch.tuning import points as tp

KERNEL_SCHEMA = ("jsd_loss_and_grad(Tensor(a!) student_logits, Tensor teacher_logits, Tensor? labels=None, *, "
                 "float beta=0.5, int ignore_index=-100, float temperature=1.0, Tensor? grad_scale=None) -> Tensor")
SCHEMA = ("fused_linear_jsd(Tensor student_input, Tensor student_weight, Tensor teacher_input, "
          "Tensor teacher_weight, Tensor? shift_labels=None, *, float jsd_beta=0.5, int ignore_index=-100, "
          "float temperature=1.0, bool scale_by_temperature_squared=False, ScalarType? accum_dtype=None, "
          "str? process_group=None) -> Tensor")
VP_STATS_SCHEMA = ("jsd_vp_stats(Tensor student_logits, Tensor teacher_logits, Tensor? labels=None, *, "
                   "int ignore_index=-100, float temperature=1.0) -> Tensor")
VP_SUMS_SCHEMA = ("jsd_vp_sums(Tensor student_logits, Tensor teacher_logits, Tensor lse, Tensor? labels=None, *, "
                  "float beta=0.5, int ignore_index=-100, float temperature=1.0) -> Tensor")
VP_GRAD_SCHEMA = ("jsd_vp_grad(Tensor(a!) student_logits, Tensor teacher_logits, Tensor lse, Tensor sums, "
                  "Tensor? labels=None, *, float beta=0.5, int ignore_index=-100, float temperature=1.0, "
                  "Tensor? grad_scale=None) -> ()")


# ---------------------------------------------------------------- checks


def check_fused_linear_jsd(a):
    n, vocab = heads.head("student_input", a.student_input, "student_weight", a.student_weight)
    n_t, vocab_t = heads.head("teacher_input", a.teacher_input, "teacher_weight", a.teacher_weight)
    c.dim_equals("teacher_input", n_t, n, "number of rows", "student_input's")
    c.dim_equals("teacher_weight", vocab_t, vocab, "vocabulary size (dim 0)", "student_weight's")
    c.same_device(student_input=a.student_input, student_weight=a.student_weight, teacher_input=a.teacher_input,
                  teacher_weight=a.teacher_weight, shift_labels=a.shift_labels)
    c.in_range("jsd_beta", a.jsd_beta, 0.0, 1.0)
    c.positive("temperature", a.temperature)
    c.boolean("scale_by_temperature_squared", a.scale_by_temperature_squared)
    c.integer("ignore_index", a.ignore_index)
    heads.row_labels("shift_labels", a.shift_labels, "student_input", a.student_input)
    heads.accum_dtype(a.accum_dtype)


def check_kernel(a):
    heads.scaled_student("teacher_logits", a)
    c.in_range("beta", a.beta, 0.0, 1.0)


def check_vp_stats(a):
    heads.student_and("teacher_logits", a)


def check_vp_sums(a):
    check_vp_stats(a)
    heads.row_stats("lse", a.lse, a.student_logits.shape[0], 2)
    c.same_device(student_logits=a.student_logits, lse=a.lse)
    c.in_range("beta", a.beta, 0.0, 1.0)


def check_vp_grad(a):
    check_vp_sums(a)
    n = a.student_logits.shape[0]
    heads.row_stats("sums", a.sums, n, 2)
    c.grad_scale(a.grad_scale, n)
    c.same_device(student_logits=a.student_logits, sums=a.sums, grad_scale=a.grad_scale)


def probe(a):
    return ((heads.logits_spec(a.student_input, a.student_weight), heads.logits_spec(a.teacher_input, a.teacher_weight),
             heads.rows_spec(a.shift_labels)), dict(beta=a.jsd_beta, ignore_index=a.ignore_index,
                                                    temperature=a.temperature))


# ---------------------------------------------------------------- the composition


def grad_bound(teacher_x, teacher_weight, *, beta, temperature) -> Bound:
    """A bound of each row's gradient L1 norm over the raw student logits (fp16 buffers, grad_bounds.py). beta < 1:
    2 / T (for 0 < beta < 1 the gradient is a - q sum(a) with a = (1 - beta) q log(q / m), whose L1 norm is at most
    2 / e since m >= (1 - beta) q); beta = 1: a = q log(q / p), so 2 (1/e + max_j -log p_j) / T with
    -log p_j <= range of the teacher's logits / T + log V."""
    if beta < 1.0:
        return 2.0 / temperature
    neg_log_p = 2.0 * logit_bound(teacher_x, teacher_weight) / temperature + math.log(teacher_weight.shape[0])
    return 2.0 * (1.0 / math.e + neg_log_p) / temperature


def compose(kernel, vocab_parallel=None):
    """fused_linear_jsd from a backend's jsd_loss_and_grad; the teacher is never differentiated."""

    def fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None, *,
                         jsd_beta=0.5, ignore_index=-100, temperature=1.0, scale_by_temperature_squared=False,
                         accum_dtype=None, process_group=None, need_grads=(), logits_grad=False):
        want_dx, want_dw = fl.wanted_grads(need_grads, 2)
        x = fl.flat(student_input, student_input.shape[-1])
        xt = fl.flat(teacher_input, teacher_input.shape[-1])
        labels = None if shift_labels is None else fl.flat(shift_labels).long()
        factor = temperature * temperature if scale_by_temperature_squared else 1.0
        # without a gradient to scale, the mean is taken after the rows (fl.mean_after)
        scale = fl.mean_scale(labels, x.shape[0], ignore_index, x.device, factor) if want_dx or want_dw else None
        teacher = []  # the teacher's logits buffer, made by the first chunk: the largest

        def chunk_loss(logits, start, end, chunk_scale):
            if not teacher:
                teacher.append(torch.empty(logits.shape, dtype=xt.dtype, device=xt.device))
            t_logits = fl.chunk_of(teacher[0], 0, end - start)
            torch.mm(fl.chunk_of(xt, start, end), teacher_weight.t(), out=t_logits)
            return kernel(logits, t_logits, fl.chunk_of(labels, start, end), beta=jsd_beta, ignore_index=ignore_index,
                          temperature=temperature, grad_scale=chunk_scale)

        rows, dx, dw, _ = fl.run_chunks(
            x, student_weight, None, scale, chunk_loss, extra_bytes_per_logit=xt.element_size(), want_dx=want_dx,
            want_dw=want_dw, want_db=False, accum_dtype=accum_dtype, vocab_parallel=vocab_parallel,
            logits_grad=logits_grad, row_bound=lambda: grad_bound(xt, teacher_weight, beta=jsd_beta, temperature=temperature))
        loss = fl.mean_after(rows, labels, ignore_index, factor)[0] if scale is None else rows.sum() * scale
        return loss, None if dx is None else dx.view(student_input.shape), dw

    return fused_linear_jsd


# ---------------------------------------------------------------- vocab-parallel


def vocab_parallel_kernel(shard: VocabShard, kernels):
    """jsd_loss_and_grad of the composition, over this rank's slice."""

    def jsd_loss_and_grad(student_logits, teacher_logits, labels=None, *, beta=0.5, ignore_index=-100,
                          temperature=1.0, grad_scale=None):
        common = dict(ignore_index=ignore_index, temperature=temperature)
        lse = shard.combine(kernels("jsd_vp_stats", student_logits, teacher_logits, labels, **common), lse_columns=2)
        sums = kernels("jsd_vp_sums", student_logits, teacher_logits, lse, labels, beta=beta, **common)
        shard.sum_over_ranks(sums)
        kernels("jsd_vp_grad", student_logits, teacher_logits, lse, sums, labels, beta=beta, grad_scale=grad_scale,
                **common)
        return sums[:, 0]

    return jsd_loss_and_grad


# ---------------------------------------------------------------- tuning


def bucket(student_input, student_weight, *_args, jsd_beta=0.5, **_):
    """2-pass (beta 0 or 1) and 3-pass kernels rank differently."""
    beta = "0" if jsd_beta == 0.0 else "1" if jsd_beta == 1.0 else "mixture"
    return tp.pow2_ceil(tp.rows(student_input)), (("v", tp.pow2_ceil(student_weight.shape[0])), ("beta", beta))


def tune_points(n, hidden, vocab, dtype, device, args):
    """One point a beta of --betas, on one student and teacher."""
    shape, check = tp.lm_shape(n, hidden, vocab)
    x, w = tp.lm_head(n, hidden, vocab, dtype, device)
    xt, wt = (t.detach() for t in tp.lm_head(n, hidden, vocab, dtype, device))
    labels = tp.labels(n, vocab, device)
    for beta in args.betas:
        yield tp.Point("fused_linear_jsd", shape, tp.Inputs((x, w, xt, wt, labels), {"jsd_beta": beta}, [x, w]), check)


TUNE_ARGUMENTS = ((("--betas",), dict(nargs="+", type=float, default=[0.5, 0.0, 1.0],
                                      help="fused_linear_jsd betas")),)


OPS = (
    OpSpec(KERNEL_SCHEMA, "kernel", check_kernel, fake=heads.fake_rows,
           summary="per-row JSD of student vs teacher logits; gradient written into the student's"),
    OpSpec(VP_STATS_SCHEMA, "kernel", check_vp_stats, fake=heads.fake_stats(2),
           summary="vocab-parallel JSD: a slice's lse of student and teacher"),
    OpSpec(VP_SUMS_SCHEMA, "kernel", check_vp_sums, fake=heads.fake_stats(2),
           summary="vocab-parallel JSD: a slice's part of the loss and cross term"),
    OpSpec(VP_GRAD_SCHEMA, "kernel", check_vp_grad, fake=heads.fake_in_place,
           summary="vocab-parallel JSD: a slice's gradient from the global stats"),
    OpSpec(SCHEMA, "user", check_fused_linear_jsd, composed_of=("jsd_loss_and_grad",), compose=compose, probe=probe,
           differentiable=("student_input", "student_weight"),
           autocast=("student_input", "student_weight", "teacher_input", "teacher_weight"), impl_extra=f"{heads.NEED_GRADS}, {heads.LOGITS_GRAD}",
           fake=heads.fake_scalar_loss,
           logits_grad=lambda a: heads.keeps_logits_grad(a.student_input, a.student_weight, a.accum_dtype,
                                                         a.process_group, a.teacher_input.element_size()),
           vocab_parallel=VocabParallel("student_weight", sliced={"student_weight": 0, "teacher_weight": 0},
                                        replicated={"student_input": False, "teacher_input": True,
                                                    "shift_labels": True}, kernel=vocab_parallel_kernel),
           tuning=tp.Tuning(bucket, tp.lm_head_groups(tune_points), TUNE_ARGUMENTS),
           summary="fused linear generalized JSD for distillation"),
)
BACKEND_MODULES = {"jsd_loss_and_grad": "jsd", "jsd_vp_stats": "vocab_parallel", "jsd_vp_sums": "vocab_parallel",
                   "jsd_vp_grad": "vocab_parallel"}


# ---------------------------------------------------------------- conformance cases and samples (testing.py)
STUDENT = ("student_input", "student_weight")
TEACHER = ("teacher_input", "teacher_weight")  # never differentiated


def _jsd(beta, temperature, t_squared, strided=False):
    def build(m: Inputs):
        h_t = m.H + 8  # the teacher's hidden size may differ from the student's
        inputs = dict(student_input=m.randn(m.N, m.H), student_weight=m.weight(), teacher_input=m.randn(m.N, h_t),
                      teacher_weight=m.weight(hidden=h_t), shift_labels=m.labels(m.N, ignored=(2,), strided=strided))
        return inputs, dict(jsd_beta=beta, temperature=temperature, scale_by_temperature_squared=t_squared)
    return build


def _jsd_no_labels(all_ignored):
    def build(m: Inputs):
        inputs = dict(student_input=non_contiguous(m.randn(m.N, m.H)), student_weight=m.weight(),
                      teacher_input=m.randn(m.N, m.H), teacher_weight=m.weight())
        if all_ignored:
            return {**inputs, "shift_labels": m.labels(m.N, all_ignored=True)}, {}
        return inputs, dict(jsd_beta=0.3)
    return build


def _empty(with_labels=False, **options):
    def build(m: Inputs):
        x, w = empty_head(m)
        rows = m.labels(0) if with_labels else None
        inputs = dict(student_input=x, student_weight=w, teacher_input=m.randn(0, m.H),
                      teacher_weight=m.randn(m.V, m.H), shift_labels=rows)
        return empty_leaves(inputs, frozen=TEACHER), options
    return build


def _fp16_overflow(**options):
    def build(m: Inputs):
        x, w = overflow_head(m, 1.0)
        return dict(student_input=x, student_weight=w, teacher_input=m.randn(m.N, m.H, scale=4.0),
                    teacher_weight=m.weight()), options
    return build


def _fp16_beyond(m: Inputs):
    """Reverse KL from a teacher with log-probabilities down to ~-500 (the loss is a mean: no reduction to set)."""
    x, w = beyond_fp16_head(m)
    (rows, hidden), vocab = x.shape, w.shape[0]
    inputs = dict(student_input=x, student_weight=w, teacher_input=m.randn(rows, hidden),
                  teacher_weight=m.randn(vocab, hidden, scale=32.0))
    return inputs, dict(jsd_beta=1.0)


CASES = {"fused_linear_jsd": [
    *(Case(f"beta{beta}-T{t}" + ("-t2" if t2 else ""), _jsd(beta, t, t2), STUDENT,
           smoke=(beta, t) == (0.5, 2.0), sample=(beta, t) == (0.5, 2.0))
      for t, t2 in ((1.0, False), (2.0, True), (0.7, False)) for beta in (0.0, 0.5, 1.0)),
    Case("no_labels_noncontiguous", _jsd_no_labels(False), STUDENT),
    Case("strided_labels", _jsd(0.5, 1.0, False, strided=True), STUDENT),
    Case("all_ignored", _jsd_no_labels(True), STUDENT),
    Case("empty", _empty(jsd_beta=0.5), kind="empty", extra_dtypes=FP16),
    Case("empty-forward-kl-labels", _empty(jsd_beta=0.0, with_labels=True), kind="empty", extra_dtypes=FP16),
    Case("fp16-cold", _fp16_overflow(jsd_beta=0.0, temperature=0.05), STUDENT, dtypes=FP16),
    Case("fp16-reverse-cold", _fp16_overflow(jsd_beta=1.0, temperature=0.25), STUDENT, dtypes=FP16),
    Case("fp16-grad-beyond-fp16", _fp16_beyond, STUDENT, upstream=0.25, dtypes=FP16),
]}


def _jsd_sample(m: Inputs):
    return (m.randn(6, 40, scale=4.0), m.randn(6, 40, scale=4.0), sample_labels(m)), dict(beta=0.3, temperature=2.0)


def _vp_sample(which):
    """jsd_vp_sums' or jsd_vp_grad's sample: the passes before it run on the reference."""
    def build(m: Inputs):
        from liger_dispatch import dispatch

        s, t, labels = m.randn(6, 40, scale=4.0), m.randn(6, 40, scale=4.0), sample_labels(m)
        lse = dispatch.op("jsd_vp_stats", backend="reference")(s, t, labels)
        if which == "sums":
            return (s, t, lse, labels), dict(beta=0.3)
        sums = dispatch.op("jsd_vp_sums", backend="reference")(s, t, lse, labels, beta=0.3)
        return (s, t, lse, sums, labels), dict(beta=0.3)
    return build


SAMPLES = {
    "jsd_loss_and_grad": _jsd_sample,
    "jsd_vp_stats": lambda m: ((m.randn(6, 40, scale=4.0), m.randn(6, 40, scale=4.0), sample_labels(m)),
                               dict(temperature=2.0)),
    "jsd_vp_sums": _vp_sample("sums"),
    "jsd_vp_grad": _vp_sample("grad"),
}
