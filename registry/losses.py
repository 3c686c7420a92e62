"""Op specs of the losses: fused-linear cross-entropy, JSD and KL, and their kernel-level ops."""

from __future__ import annotations

import math

import torch

from liger_dispatch.errors import InputError
from liger_dispatch.core.table import TABLE, OpSpec, TensorSpec
from liger_dispatch.registry import checks as c

COMPOSITIONS = "liger_dispatch.compose.fused_linear"


def _head(input_name, input, weight_name, weight):
    """Checks an LM-head pair input [..., H] / weight [V, H]; returns (N, V)."""
    c.tensor(input_name, input, min_ndim=1, floating=True)
    c.tensor(weight_name, weight, ndim=2, floating=True)
    c.same_dtype(input_name, input, weight_name, weight)
    if weight.shape[1] != input.shape[-1] == weight.shape[0]:
        raise InputError(f"{weight_name} has shape {tuple(weight.shape)} but must be [V, H] (vocabulary, hidden; "
                         f"{input_name}'s H is {input.shape[-1]}), as lm_head.weight is: was it passed transposed?")
    c.dim_equals(input_name, input.shape[-1], weight.shape[1], "hidden size (last dim)", f"{weight_name}'s dim 1")
    return input.shape[:-1].numel(), weight.shape[0]


def _accum_dtype(accum_dtype):
    if accum_dtype not in (None, torch.float32):
        raise InputError(f"accum_dtype must be None (the weight's dtype) or torch.float32, got {accum_dtype!r}")


def _labels(name, labels, n):
    if labels is None:
        return
    c.tensor(name, labels, integer=True)
    c.rows(name, labels.numel(), n, "number of labels")


def check_flce(a):
    n, vocab = _head("input", a.input, "weight", a.weight)
    c.tensor("target", a.target, integer=True)
    if a.bias is not None:
        c.tensor("bias", a.bias, ndim=1, floating=True)
        c.dim_equals("bias", a.bias.shape[0], vocab, "length")
    c.same_device(input=a.input, weight=a.weight, target=a.target, bias=a.bias)
    c.integer("ignore_index", a.ignore_index)
    c.choice("reduction", a.reduction, ("mean", "sum", "none"))
    c.in_range("label_smoothing", a.label_smoothing, 0.0, 1.0)
    if a.softcap is not None:
        c.positive("softcap", a.softcap)
    c.non_negative("lse_square_scale", a.lse_square_scale)
    _labels("target", a.target, n)
    _accum_dtype(a.accum_dtype)


def check_fused_linear_jsd(a):
    n, vocab = _head("student_input", a.student_input, "student_weight", a.student_weight)
    n_t, vocab_t = _head("teacher_input", a.teacher_input, "teacher_weight", a.teacher_weight)
    c.dim_equals("teacher_input", n_t, n, "number of rows", "student_input's")
    c.dim_equals("teacher_weight", vocab_t, vocab, "vocabulary size (dim 0)", "student_weight's")
    c.same_device(student_input=a.student_input, student_weight=a.student_weight, teacher_input=a.teacher_input,
                  teacher_weight=a.teacher_weight, shift_labels=a.shift_labels)
    c.in_range("jsd_beta", a.jsd_beta, 0.0, 1.0)
    c.positive("temperature", a.temperature)
    c.integer("ignore_index", a.ignore_index)
    _labels("shift_labels", a.shift_labels, n)
    _accum_dtype(a.accum_dtype)


def check_fused_linear_kl_div(a):
    if a.reduction == "none":
        raise InputError("reduction='none' is not supported by fused_linear_kl_div: the gradient is produced in the "
                         "forward pass chunk by chunk and needs a scalar loss; use 'batchmean', 'mean' or 'sum'")
    n, vocab = _head("student_input", a.student_input, "student_weight", a.student_weight)
    c.tensor("target", a.target, min_ndim=1, floating=True)
    c.dim_equals("target", a.target.shape[-1], vocab, "last dim (vocabulary size)", "student_weight's dim 0")
    c.rows("target", a.target.shape[:-1].numel(), n)
    c.same_device(student_input=a.student_input, student_weight=a.student_weight, target=a.target,
                  shift_labels=a.shift_labels)
    c.choice("reduction", a.reduction, ("batchmean", "mean", "sum"))
    c.positive("temperature", a.temperature)
    c.non_negative("eps", a.eps)
    c.integer("ignore_index", a.ignore_index)
    _labels("shift_labels", a.shift_labels, n)
    _accum_dtype(a.accum_dtype)


def _logits(name, logits):
    c.tensor(name, logits, ndim=2, floating=True)
    c.last_dim_contiguous(name, logits)
    return logits.shape


def check_ce_loss_and_grad(a):
    n, vocab = _logits("logits", a.logits)
    c.tensor("target", a.target, ndim=1, integer=True)
    c.same_device(logits=a.logits, target=a.target, grad_scale=a.grad_scale)
    c.grad_scale(a.grad_scale, n)
    c.integer("ignore_index", a.ignore_index)
    c.in_range("label_smoothing", a.label_smoothing, 0.0, 1.0)
    if a.softcap is not None:
        c.positive("softcap", a.softcap)
    c.non_negative("lse_square_scale", a.lse_square_scale)
    _labels("target", a.target, n)


def _student_and(other_name, a):
    """The checks a kernel-level op on a student logits chunk and a second [C, V] tensor share."""
    other = getattr(a, other_name)
    n, _ = _logits("student_logits", a.student_logits)
    _logits(other_name, other)
    if other.shape != a.student_logits.shape:
        raise InputError(f"{other_name} has shape {tuple(other.shape)} but student_logits has "
                         f"{tuple(a.student_logits.shape)}")
    c.same_device(student_logits=a.student_logits, **{other_name: other}, labels=a.labels, grad_scale=a.grad_scale)
    c.grad_scale(a.grad_scale, n)
    c.positive("temperature", a.temperature)
    c.integer("ignore_index", a.ignore_index)
    _labels("labels", a.labels, n)


def check_jsd_loss_and_grad(a):
    _student_and("teacher_logits", a)
    c.in_range("beta", a.beta, 0.0, 1.0)


def check_kl_div_loss_and_grad(a):
    _student_and("target", a)
    c.non_negative("eps", a.eps)


def flce_classes(a):
    """The class-index check of flce's target: it needs the values, so it runs where the op runs. With a
    process_group the weight is a slice: the vocab-parallel driver checks against the whole vocabulary."""
    if a.process_group is None:
        c.class_indices("target", a.target, a.weight.shape[0], a.ignore_index)


def ce_classes(a):
    c.class_indices("target", a.target, a.logits.shape[1], a.ignore_index)


def _logits_spec(input, weight):
    """The [rows, V] logits buffer a fused-linear composition makes."""
    return TensorSpec((math.prod(input.shape[:-1]), weight.shape[0]), input.dtype)


def _rows_by_last(t):
    """t as the composition flattens it to 2-D, keeping its last dim."""
    return TensorSpec((math.prod(t.shape[:-1]), t.shape[-1]), t.dtype)


def _rows_spec(labels):
    """Per-row labels as the composition passes them (flattened), or None."""
    return None if labels is None else TensorSpec((labels.numel(),), labels.dtype)


def probe_flce(a):
    return ((_logits_spec(a.input, a.weight), _rows_spec(a.target)),
            dict(ignore_index=a.ignore_index, label_smoothing=a.label_smoothing, softcap=a.softcap,
                 lse_square_scale=a.lse_square_scale))


def probe_fused_linear_jsd(a):
    return ((_logits_spec(a.student_input, a.student_weight), _logits_spec(a.teacher_input, a.teacher_weight),
             _rows_spec(a.shift_labels)), dict(beta=a.jsd_beta, ignore_index=a.ignore_index, temperature=a.temperature))


def probe_fused_linear_kl_div(a):
    return ((_logits_spec(a.student_input, a.student_weight), _rows_by_last(a.target), _rows_spec(a.shift_labels)),
            dict(ignore_index=a.ignore_index, temperature=a.temperature, eps=a.eps, log_target=a.log_target))


def fake_rows(a, *columns: int):
    """A kernel-level op's per-row output [C, *columns], fp32 (float64 for float64 logits, as the reference
    computes): the per-row loss, or a pass's per-row statistics."""
    logits = getattr(a, "logits", None)
    logits = a.student_logits if logits is None else logits
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.new_empty(logits.shape[0], *columns, dtype=dtype)


def fake_scalar_loss(a):
    return a.student_input.new_empty((), dtype=torch.float32)


def fake_flce(a):
    shape = tuple(a.target.shape) if a.reduction == "none" else ()
    return a.input.new_empty(shape, dtype=torch.float32)


# process_group (vocab-parallel, liger_dispatch/compose/vocab_parallel.py): the weight is this rank's slice of the
# vocabulary. Eager calls pass a torch.distributed ProcessGroup; the torch op's argument is its group name.
# What the implementations of a fused-linear loss take beyond its schema: which of the op's `differentiable`
# tensors need their gradient (computed in the forward pass), and for flce per-row weights of the loss (the
# backward of reduction="none" is the gradient of sum_i w_i loss_i).
NEED_GRADS = "bool[] need_grads=[]"
ROW_WEIGHTS = "Tensor? row_weights=None"

CE_SCHEMA = ("ce_loss_and_grad(Tensor(a!) logits, Tensor target, *, Tensor? grad_scale=None, int ignore_index=-100, "
             "float label_smoothing=0.0, float? softcap=None, float lse_square_scale=0.0) -> Tensor")
JSD_SCHEMA = ("jsd_loss_and_grad(Tensor(a!) student_logits, Tensor teacher_logits, Tensor? labels=None, *, "
              "float beta=0.5, int ignore_index=-100, float temperature=1.0, Tensor? grad_scale=None) -> Tensor")
KL_SCHEMA = ("kl_div_loss_and_grad(Tensor(a!) student_logits, Tensor target, Tensor? labels=None, *, "
             "int ignore_index=-100, float temperature=1.0, float eps=1e-10, bool log_target=False, "
             "Tensor? grad_scale=None) -> Tensor")
FLCE_SCHEMA = ("flce(Tensor input, Tensor weight, Tensor target, Tensor? bias=None, *, int ignore_index=-100, "
               "str reduction='mean', float label_smoothing=0.0, float? softcap=None, float lse_square_scale=0.0, "
               "ScalarType? accum_dtype=None, str? process_group=None) -> Tensor")
FL_JSD_SCHEMA = ("fused_linear_jsd(Tensor student_input, Tensor student_weight, Tensor teacher_input, "
                 "Tensor teacher_weight, Tensor? shift_labels=None, *, float jsd_beta=0.5, int ignore_index=-100, "
                 "float temperature=1.0, bool scale_by_temperature_squared=False, ScalarType? accum_dtype=None, "
                 "str? process_group=None) -> Tensor")
FL_KL_SCHEMA = ("fused_linear_kl_div(Tensor student_input, Tensor student_weight, Tensor target, "
                "Tensor? shift_labels=None, *, str reduction='batchmean', int ignore_index=-100, "
                "float temperature=1.0, float eps=1e-10, bool log_target=False, ScalarType? accum_dtype=None, "
                "str? process_group=None) -> Tensor")


def declare() -> None:
    TABLE.declare_op(OpSpec(CE_SCHEMA, "kernel", check_ce_loss_and_grad, value_check=ce_classes, fake=fake_rows,
                            summary="per-row cross-entropy of a logits chunk; gradient written into the logits"))
    TABLE.declare_op(OpSpec(JSD_SCHEMA, "kernel", check_jsd_loss_and_grad, fake=fake_rows,
                            summary="per-row JSD of student vs teacher logits; gradient written into the student's"))
    TABLE.declare_op(OpSpec(KL_SCHEMA, "kernel", check_kl_div_loss_and_grad, fake=fake_rows,
                            summary="per-row KL(target || student); gradient written into the student logits"))
    TABLE.declare_op(OpSpec(FLCE_SCHEMA, "user", check_flce, value_check=flce_classes,
                            aliases=("fused_linear_cross_entropy",), composed_of=("ce_loss_and_grad",),
                            compose=f"{COMPOSITIONS}:compose_flce", probe=probe_flce,
                            differentiable=("input", "weight", "bias"), autocast=("input", "weight", "bias"), impl_extra=f"{NEED_GRADS}, {ROW_WEIGHTS}", fake=fake_flce,
                            summary="fused linear + cross-entropy (label smoothing, softcap, z-loss)"))
    TABLE.declare_op(OpSpec(FL_JSD_SCHEMA, "user", check_fused_linear_jsd, composed_of=("jsd_loss_and_grad",),
                            compose=f"{COMPOSITIONS}:compose_jsd", probe=probe_fused_linear_jsd,
                            differentiable=("student_input", "student_weight"),
                            autocast=("student_input", "student_weight", "teacher_input", "teacher_weight"), impl_extra=NEED_GRADS, fake=fake_scalar_loss,
                            summary="fused linear generalized JSD for distillation"))
    TABLE.declare_op(OpSpec(FL_KL_SCHEMA, "user", check_fused_linear_kl_div, composed_of=("kl_div_loss_and_grad",),
                            compose=f"{COMPOSITIONS}:compose_kl_div", probe=probe_fused_linear_kl_div,
                            differentiable=("student_input", "student_weight"), autocast=("student_input", "student_weight"), impl_extra=NEED_GRADS, fake=fake_scalar_loss,
                            summary="fused linear KL divergence against explicit target probabilities"))
