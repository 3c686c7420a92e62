"""KL divergence of a student's LM head against explicit target probabilities, for distillation: the user-level
`fused_linear_kl_div` and the kernel-level ops it is composed of.

    fused_linear_kl_div(student_input [..., H], student_weight [V, H], target [..., V], shift_labels?) -> loss
    kl_div_loss_and_grad(student_logits [C, V], target [C, V], labels?) -> loss rows; student logits overwritten
    kl_div_vp_stats / kl_div_vp_grad: the same over one rank's vocabulary slice (vocab-parallel)

Per row KL(target || softmax(s / T)) = sum_j q_j (log max(q_j, eps) - log_softmax(s / T)_j), 0 log 0 = 0; `target`
holds probabilities, or log-probabilities with log_target=True. batchmean: sum / non-ignored rows; mean: sum /
(non-ignored rows * V); sum: sum. Vocab-parallel statistics per row of a slice: (lse, sum q, sum q log q,
sum q s), combined by a log-sum-exp of the first column and sums of the others.
"""

from __future__ import annotations

import torch

from liger_dispatch import settings
from liger_dispatch.compose import fused_linear as fl
from liger_dispatch.compose.grad_bounds import TEMP_ELEMENTS, Bound, norm, wide
from liger_dispatch.compose.vocab_parallel import VocabParallel, VocabShard
from liger_dispatch.core.table import OpSpec
from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks as c
from liger_dispatch.registry import heads
from liger_dispatch.registry.cases import (FP16, Case, Inputs, beyond_fp16_head, empty_head, empty_leaves,
                                           overflow_head, sample_labels)
from liger_dispatch.tuning import points as tp

KERNEL_SCHEMA = ("kl_div_loss_and_grad(Tensor(a!) student_logits, Tensor target, Tensor? labels=None, *, "
                 "int ignore_index=-100, float temperature=1.0, float eps=1e-10, bool log_target=False, "
                 "Tensor? grad_scale=None) -> Tensor")
SCHEMA = ("fused_linear_kl_div(Tensor student_input, Tensor student_weight, Tensor target, "
          "Tensor? shift_labels=None, *, str reduction='batchmean', int ignore_index=-100, "
          "float temperature=1.0, float eps=1e-10, bool log_target=False, ScalarType? accum_dtype=None, "
          "str? process_group=None) -> Tensor")
VP_STATS_SCHEMA = ("kl_div_vp_stats(Tensor student_logits, Tensor target, Tensor? labels=None, *, "
                   "int ignore_index=-100, float temperature=1.0, float eps=1e-10, bool log_target=False) -> Tensor")
VP_GRAD_SCHEMA = ("kl_div_vp_grad(Tensor(a!) student_logits, Tensor target, Tensor lse, Tensor target_sum, "
                  "Tensor? labels=None, *, int ignore_index=-100, float temperature=1.0, bool log_target=False, "
                  "Tensor? grad_scale=None) -> ()")


# ---------------------------------------------------------------- checks


def check_fused_linear_kl_div(a):
    if a.reduction == "none":
        raise InputError("reduction='none' is not supported by fused_linear_kl_div: the gradient is produced in the "
                         "forward pass chunk by chunk and needs a scalar loss; use 'batchmean', 'mean' or 'sum'")
    _, vocab = heads.head("student_input", a.student_input, "student_weight", a.student_weight)
    c.tensor("target", a.target, min_ndim=1, floating=True)
    c.dim_equals("target", a.target.shape[-1], vocab, "last dim (vocabulary size)", "student_weight's dim 0")
    c.leading_shape("target", a.target.shape[:-1], "student_input", a.student_input,
                    "leading shape (all but the last dim)")
    c.same_device(student_input=a.student_input, student_weight=a.student_weight, target=a.target,
                  shift_labels=a.shift_labels)
    c.choice("reduction", a.reduction, ("batchmean", "mean", "sum"))
    c.positive("temperature", a.temperature)
    c.non_negative("eps", a.eps)
    c.boolean("log_target", a.log_target)
    c.integer("ignore_index", a.ignore_index)
    heads.row_labels("shift_labels", a.shift_labels, "student_input", a.student_input)
    heads.accum_dtype(a.accum_dtype)


def check_kernel(a):
    heads.scaled_student("target", a)
    c.non_negative("eps", a.eps)
    c.boolean("log_target", a.log_target)


def check_vp_stats(a):
    heads.student_and("target", a)
    c.non_negative("eps", a.eps)
    c.boolean("log_target", a.log_target)


def check_vp_grad(a):
    n = heads.student_and("target", a)
    heads.row_stats("lse", a.lse, n, None)
    heads.row_stats("target_sum", a.target_sum, n, None)
    c.boolean("log_target", a.log_target)
    c.grad_scale(a.grad_scale, n)
    c.same_device(student_logits=a.student_logits, lse=a.lse, target_sum=a.target_sum, grad_scale=a.grad_scale)


def target_probabilities(a):
    """Under LIGER_CHECKS=full, a negative probability is an InputError naming the target (without it, its row's loss
    is NaN, as torch's kl_div gives it: benchmarks/kl_semantics.md)."""
    if settings.CHECKS.get() == "full":
        c.probabilities("target", a.target, a.log_target)


def probe(a):
    return ((heads.logits_spec(a.student_input, a.student_weight), heads.rows_by_last(a.target),
             heads.rows_spec(a.shift_labels)),
            dict(ignore_index=a.ignore_index, temperature=a.temperature, eps=a.eps, log_target=a.log_target))


# ---------------------------------------------------------------- the composition


def grad_bound(target: torch.Tensor, *, temperature, log_target) -> Bound:
    """A bound of each row's gradient L1 norm over the raw student logits (fp16 buffers, grad_bounds.py): the
    gradient is (p sum(q) - q) / T, so 2 sum_j |q_j| / T (q = exp(target) for log-targets); target [N, V]."""
    if not log_target:
        mass = norm(target, 1, dim=-1)
    else:  # sum_j exp(target_ij), row pieces at a time: exp needs a temporary
        step = max(1, TEMP_ELEMENTS // max(1, target.shape[1]))
        mass = torch.cat([torch.logsumexp(t.to(wide(t)), dim=-1).exp() for t in target.split(step)])
    return 2.0 * mass / temperature


def compose(kernel, vocab_parallel=None):
    """fused_linear_kl_div from a backend's kl_div_loss_and_grad."""

    def fused_linear_kl_div(student_input, student_weight, target, shift_labels=None, *, reduction="batchmean",
                            ignore_index=-100, temperature=1.0, eps=1e-10, log_target=False, accum_dtype=None,
                            process_group=None, need_grads=(), logits_grad=False):
        want_dx, want_dw = fl.wanted_grads(need_grads, 2)
        x = fl.flat(student_input, student_input.shape[-1])
        vocab = student_weight.shape[0]
        probs = fl.flat(target, vocab)
        if probs.stride(-1) != 1:
            probs = probs.contiguous()
        labels = None if shift_labels is None else fl.flat(shift_labels).long()
        total = vocab if vocab_parallel is None else vocab_parallel.total
        factor = 1.0 / total if reduction == "mean" else 1.0
        if reduction == "sum" or not (want_dx or want_dw):  # no gradient to scale: a mean is taken after the rows
            scale = None
        else:
            scale = fl.mean_scale(labels, x.shape[0], ignore_index, x.device, factor)

        def chunk_loss(logits, start, end, chunk_scale):
            return kernel(logits, fl.chunk_of(probs, start, end), fl.chunk_of(labels, start, end),
                          ignore_index=ignore_index, temperature=temperature, eps=eps, log_target=log_target,
                          grad_scale=chunk_scale)

        rows, dx, dw, _ = fl.run_chunks(
            x, student_weight, None, scale, chunk_loss, want_dx=want_dx, want_dw=want_dw, want_db=False,
            accum_dtype=accum_dtype, vocab_parallel=vocab_parallel, logits_grad=logits_grad,
            row_bound=lambda: grad_bound(probs, temperature=temperature, log_target=log_target))
        if reduction == "sum":
            loss = rows.sum()
        else:
            loss = fl.mean_after(rows, labels, ignore_index, factor)[0] if scale is None else rows.sum() * scale
        return loss, None if dx is None else dx.view(student_input.shape), dw

    return fused_linear_kl_div


# ---------------------------------------------------------------- vocab-parallel


def loss_rows(stats: torch.Tensor) -> torch.Tensor:
    """Per-row KL from the global kl_div_vp_stats (lse, sum q, sum q log q, sum q s); ignored rows are all 0."""
    lse, q_sum, q_log_q, q_s = stats.unbind(1)
    return q_log_q - q_s + lse * q_sum


def vocab_parallel_kernel(shard: VocabShard, kernels):
    """kl_div_loss_and_grad of the composition, over this rank's slice."""

    def kl_div_loss_and_grad(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                             log_target=False, grad_scale=None):
        common = dict(ignore_index=ignore_index, temperature=temperature, log_target=log_target)
        stats = kernels("kl_div_vp_stats", student_logits, target, labels, eps=eps, **common)
        total = shard.combine(stats, lse_columns=1)
        kernels("kl_div_vp_grad", student_logits, target, total[:, 0], total[:, 1], labels, grad_scale=grad_scale,
                **common)
        return loss_rows(total)

    return kl_div_loss_and_grad


# ---------------------------------------------------------------- tuning


def bucket(student_input, student_weight, target, *_args, log_target=False, **_):
    rest = (("v", tp.pow2_ceil(student_weight.shape[0])), ("target", str(target.dtype).replace("torch.", "")))
    return tp.pow2_ceil(tp.rows(student_input)), rest + ((("log_target", "on"),) if log_target else ())


def tune_points(n, hidden, vocab, dtype, device, args):
    """One point a target dtype: the inputs' and fp32."""
    shape, check = tp.lm_shape(n, hidden, vocab)
    x, w = tp.lm_head(n, hidden, vocab, dtype, device)
    for target_dtype in dict.fromkeys((dtype, torch.float32)):
        target = torch.empty(n, vocab, dtype=target_dtype, device=device)
        for start in range(0, n, 2048):  # bounds the fp32 temporary
            rows = target[start:start + 2048]
            rows.copy_(torch.softmax(torch.randn(rows.shape, device=device) * 2.0, dim=-1))
        yield tp.Point("fused_linear_kl_div", shape,
                       tp.Inputs((x, w, target, tp.labels(n, vocab, device)), {}, [x, w]), check)
        target = None


OPS = (
    OpSpec(KERNEL_SCHEMA, "kernel", check_kernel, value_check=target_probabilities, fake=heads.fake_rows,
           summary="per-row KL(target || student); gradient written into the student logits"),
    OpSpec(VP_STATS_SCHEMA, "kernel", check_vp_stats, fake=heads.fake_stats(4),
           summary="vocab-parallel KL: a slice's row stats (lse, q, q log q, q s)"),
    OpSpec(VP_GRAD_SCHEMA, "kernel", check_vp_grad, fake=heads.fake_in_place,
           summary="vocab-parallel KL: a slice's gradient from the global stats"),
    OpSpec(SCHEMA, "user", check_fused_linear_kl_div, value_check=target_probabilities,
           composed_of=("kl_div_loss_and_grad",), compose=compose,
           probe=probe, differentiable=("student_input", "student_weight"),
           autocast=("student_input", "student_weight"), impl_extra=f"{heads.NEED_GRADS}, {heads.LOGITS_GRAD}",
           fake=heads.fake_scalar_loss,
           logits_grad=lambda a: heads.keeps_logits_grad(a.student_input, a.student_weight, a.accum_dtype,
                                                         a.process_group),
           vocab_parallel=VocabParallel("student_weight", sliced={"student_weight": 0, "target": -1},
                                        replicated={"student_input": False, "shift_labels": True},
                                        kernel=vocab_parallel_kernel),
           tuning=tp.Tuning(bucket, tp.lm_head_groups(tune_points)),
           summary="fused linear KL divergence against explicit target probabilities"),
)
BACKEND_MODULES = {"kl_div_loss_and_grad": "kl_div", "kl_div_vp_stats": "vocab_parallel",
                   "kl_div_vp_grad": "vocab_parallel"}


# ---------------------------------------------------------------- conformance cases and samples (testing.py)
STUDENT = ("student_input", "student_weight")


def _kl(reduction, log_target, zeros, temperature):
    def build(m: Inputs):
        inputs = dict(student_input=m.randn(m.N, m.H), student_weight=m.weight(),
                      target=m.kl_target(m.N, log_target, zeros), shift_labels=m.labels(m.N, ignored=(3,)))
        return inputs, dict(reduction=reduction, log_target=log_target, temperature=temperature)
    return build


def _empty(with_labels=False, **options):
    def build(m: Inputs):
        x, w = empty_head(m)
        rows = m.labels(0) if with_labels else None
        inputs = dict(student_input=x, student_weight=w,
                      target=m.randn(0, m.V, dtype=torch.float32).softmax(-1).to(m.dtype), shift_labels=rows)
        return empty_leaves(inputs, frozen=("target",)), options
    return build


def _fp16_overflow(**options):
    def build(m: Inputs):
        _, w = overflow_head(m, 1.0)
        x = m.randn(m.N, m.H, scale=4.0)  # a confident student instead: softmax near one-hot
        return dict(student_input=x, student_weight=w,
                    target=torch.softmax(m.randn(m.N, m.V, dtype=torch.float32), -1).to(m.dtype)), options
    return build


def _fp16_beyond(m: Inputs):
    """Every row's target all on one vocabulary row."""
    x, w = beyond_fp16_head(m)
    (rows, _), vocab = x.shape, w.shape[0]
    target = torch.zeros(rows, vocab, device=m.device).index_fill_(1, torch.tensor([3], device=m.device), 1.0)
    return dict(student_input=x, student_weight=w, target=target.to(m.dtype)), dict(reduction="sum")


CASES = {"fused_linear_kl_div": [
    *(Case(f"{reduction}-{kind}-T{t}", _kl(reduction, log_target, zeros, t), STUDENT,
           smoke=(reduction, kind) == ("batchmean", "zeros"), sample=(reduction, kind) == ("batchmean", "zeros"))
      for kind, log_target, zeros, t in (("zeros", False, True, 1.0), ("log_target", True, False, 2.0),
                                         ("probs", False, False, 0.5))
      for reduction in ("batchmean", "mean", "sum")),
    Case("empty-batchmean", _empty(reduction="batchmean"), kind="empty", extra_dtypes=FP16),
    Case("empty-mean-labels", _empty(reduction="mean", with_labels=True), kind="empty", extra_dtypes=FP16),
    Case("empty-sum-log_target", _empty(reduction="sum", log_target=True), kind="empty", extra_dtypes=FP16),
    # probabilities passed as log-probabilities (as liger-kernel's own tests do): exp(target) sums to ~V per row
    Case("fp16-unnormalized", _fp16_overflow(log_target=True, reduction="sum"), STUDENT, dtypes=FP16),
    Case("fp16-grad-beyond-fp16", _fp16_beyond, STUDENT, upstream=0.25, dtypes=FP16),
]}


def _kl_sample(m: Inputs):
    return (m.randn(6, 40, scale=4.0), torch.softmax(m.randn(6, 40), -1), sample_labels(m)), dict(temperature=1.5)


def _vp_grad_sample(m: Inputs):
    from liger_dispatch import dispatch

    s, target, labels = m.randn(6, 40, scale=4.0), torch.softmax(m.randn(6, 40), -1), sample_labels(m)
    stats = dispatch.op("kl_div_vp_stats", backend="reference")(s, target, labels)
    return (s, target, stats[:, 0].contiguous(), stats[:, 1].contiguous(), labels), {}


SAMPLES = {
    "kl_div_loss_and_grad": _kl_sample,
    "kl_div_vp_stats": lambda m: ((m.randn(6, 40, scale=4.0), torch.softmax(m.randn(6, 40), -1), sample_labels(m)),
                                  {}),
    "kl_div_vp_grad": _vp_grad_sample,
}
