"""Op specs of the losses: fused-linear cross-entropy, JSD and KL, and their kernel-level ops."""

from __future__ import annotations

import math

import torch

from liger_dispatch import fused_linear
from liger_dispatch.errors import InputError
from liger_dispatch.table import TABLE, OpSpec, TensorSpec
from liger_dispatch.registry import checks as c


def _head(input_name, input, weight_name, weight):
    """Checks an LM-head pair input [..., H] / weight [V, H]; returns (N, V)."""
    c.tensor(input_name, input, min_ndim=1, floating=True)
    c.tensor(weight_name, weight, ndim=2, floating=True)
    c.same_dtype(input_name, input, weight_name, weight)
    c.dim_equals(input_name, input.shape[-1], weight.shape[1], f"hidden size (last dim, {weight_name} has {weight.shape[1]})")
    return input.shape[:-1].numel(), weight.shape[0]


def _accum_dtype(accum_dtype):
    if accum_dtype not in (None, torch.float32):
        raise InputError(f"accum_dtype must be None (the weight's dtype) or torch.float32, got {accum_dtype!r}")


def _labels(name, labels, n, vocab, ignore_index, *, class_values: bool):
    if labels is None:
        return
    c.tensor(name, labels, integer=True)
    c.rows(name, labels.numel(), n, "number of labels")
    if class_values:
        c.class_indices(name, labels, vocab, ignore_index)


def check_flce(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
               softcap=None, lse_square_scale=0.0, accum_dtype=None, process_group=None):
    n, vocab = _head("input", input, "weight", weight)
    c.tensor("target", target, integer=True)
    if bias is not None:
        c.tensor("bias", bias, ndim=1, floating=True)
        c.dim_equals("bias", bias.shape[0], vocab, "length")
    c.same_device(input=input, weight=weight, target=target, bias=bias)
    c.integer("ignore_index", ignore_index)
    c.choice("reduction", reduction, ("mean", "sum", "none"))
    c.in_range("label_smoothing", label_smoothing, 0.0, 1.0)
    if softcap is not None:
        c.positive("softcap", softcap)
    c.non_negative("lse_square_scale", lse_square_scale)
    # with process_group the weight is a slice: the driver checks the classes against the whole vocabulary
    _labels("target", target, n, vocab, ignore_index, class_values=process_group is None)
    _accum_dtype(accum_dtype)


def check_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None, *,
                           jsd_beta=0.5, ignore_index=-100, temperature=1.0, scale_by_temperature_squared=False,
                           accum_dtype=None, process_group=None):
    n, vocab = _head("student_input", student_input, "student_weight", student_weight)
    n_t, vocab_t = _head("teacher_input", teacher_input, "teacher_weight", teacher_weight)
    c.dim_equals("teacher_input", n_t, n, "number of rows (student_input's)")
    c.dim_equals("teacher_weight", vocab_t, vocab, "vocabulary size (student_weight's)")
    c.same_device(student_input=student_input, student_weight=student_weight, teacher_input=teacher_input,
                  teacher_weight=teacher_weight, shift_labels=shift_labels)
    c.in_range("jsd_beta", jsd_beta, 0.0, 1.0)
    c.positive("temperature", temperature)
    c.integer("ignore_index", ignore_index)
    _labels("shift_labels", shift_labels, n, vocab, ignore_index, class_values=False)
    _accum_dtype(accum_dtype)


def check_fused_linear_kl_div(student_input, student_weight, target, shift_labels=None, *, reduction="batchmean",
                              ignore_index=-100, temperature=1.0, eps=1e-10, log_target=False, accum_dtype=None,
                              process_group=None):
    if reduction == "none":
        raise InputError("reduction='none' is not supported by fused_linear_kl_div: the gradient is produced in the "
                         "forward pass chunk by chunk and needs a scalar loss; use 'batchmean', 'mean' or 'sum'")
    n, vocab = _head("student_input", student_input, "student_weight", student_weight)
    c.tensor("target", target, min_ndim=1, floating=True)
    c.dim_equals("target", target.shape[-1], vocab, "last dim (vocabulary size)")
    c.rows("target", target.shape[:-1].numel(), n)
    c.same_device(student_input=student_input, student_weight=student_weight, target=target, shift_labels=shift_labels)
    c.choice("reduction", reduction, ("batchmean", "mean", "sum"))
    c.positive("temperature", temperature)
    c.non_negative("eps", eps)
    c.integer("ignore_index", ignore_index)
    _labels("shift_labels", shift_labels, n, vocab, ignore_index, class_values=False)
    _accum_dtype(accum_dtype)


def _logits(name, logits):
    c.tensor(name, logits, ndim=2, floating=True)
    c.last_dim_contiguous(name, logits)
    return logits.shape


def check_ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                           lse_square_scale=0.0):
    n, vocab = _logits("logits", logits)
    c.tensor("target", target, ndim=1, integer=True)
    c.same_device(logits=logits, target=target, grad_scale=grad_scale)
    c.grad_scale(grad_scale, n)
    c.integer("ignore_index", ignore_index)
    c.in_range("label_smoothing", label_smoothing, 0.0, 1.0)
    if softcap is not None:
        c.positive("softcap", softcap)
    c.non_negative("lse_square_scale", lse_square_scale)
    _labels("target", target, n, vocab, ignore_index, class_values=True)


def check_jsd_loss_and_grad(student_logits, teacher_logits, labels=None, *, beta=0.5, ignore_index=-100,
                            temperature=1.0, grad_scale=None):
    n, vocab = _logits("student_logits", student_logits)
    _logits("teacher_logits", teacher_logits)
    if teacher_logits.shape != student_logits.shape:
        raise InputError(f"teacher_logits has shape {tuple(teacher_logits.shape)} but student_logits has "
                         f"{tuple(student_logits.shape)}")
    c.same_device(student_logits=student_logits, teacher_logits=teacher_logits, labels=labels, grad_scale=grad_scale)
    c.grad_scale(grad_scale, n)
    c.in_range("beta", beta, 0.0, 1.0)
    c.positive("temperature", temperature)
    _labels("labels", labels, n, vocab, ignore_index, class_values=False)


def check_kl_div_loss_and_grad(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                               log_target=False, grad_scale=None):
    n, vocab = _logits("student_logits", student_logits)
    _logits("target", target)
    if target.shape != student_logits.shape:
        raise InputError(f"target has shape {tuple(target.shape)} but student_logits has {tuple(student_logits.shape)}")
    c.same_device(student_logits=student_logits, target=target, labels=labels, grad_scale=grad_scale)
    c.grad_scale(grad_scale, n)
    c.positive("temperature", temperature)
    c.non_negative("eps", eps)
    _labels("labels", labels, n, vocab, ignore_index, class_values=False)


def _logits_spec(input, weight):
    """The [rows, V] logits buffer a fused-linear composition makes."""
    return TensorSpec((math.prod(input.shape[:-1]), weight.shape[0]), input.dtype)


def _rows_by_last(t):
    """t as the composition flattens it to 2-D, keeping its last dim."""
    return TensorSpec((math.prod(t.shape[:-1]), t.shape[-1]), t.dtype)


def _rows_spec(labels):
    """Per-row labels as the composition passes them (flattened), or None."""
    return None if labels is None else TensorSpec((labels.numel(),), labels.dtype)


def probe_flce(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
               softcap=None, lse_square_scale=0.0, accum_dtype=None, process_group=None):
    return ((_logits_spec(input, weight), _rows_spec(target)),
            dict(ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
                 lse_square_scale=lse_square_scale))


def probe_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None, *,
                           jsd_beta=0.5, ignore_index=-100, temperature=1.0, scale_by_temperature_squared=False,
                           accum_dtype=None, process_group=None):
    return ((_logits_spec(student_input, student_weight), _logits_spec(teacher_input, teacher_weight),
             _rows_spec(shift_labels)), dict(beta=jsd_beta, ignore_index=ignore_index, temperature=temperature))


def probe_fused_linear_kl_div(student_input, student_weight, target, shift_labels=None, *, reduction="batchmean",
                              ignore_index=-100, temperature=1.0, eps=1e-10, log_target=False, accum_dtype=None,
                              process_group=None):
    return ((_logits_spec(student_input, student_weight), _rows_by_last(target), _rows_spec(shift_labels)),
            dict(ignore_index=ignore_index, temperature=temperature, eps=eps, log_target=log_target))


def declare() -> None:
    TABLE.declare_op(OpSpec("ce_loss_and_grad", "kernel", check_ce_loss_and_grad,
                            summary="per-row cross-entropy of a logits chunk; gradient written into the logits"))
    TABLE.declare_op(OpSpec("jsd_loss_and_grad", "kernel", check_jsd_loss_and_grad,
                            summary="per-row JSD of student vs teacher logits; gradient written into the student's"))
    TABLE.declare_op(OpSpec("kl_div_loss_and_grad", "kernel", check_kl_div_loss_and_grad,
                            summary="per-row KL(target || student); gradient written into the student logits"))
    TABLE.declare_op(OpSpec("flce", "user", check_flce, aliases=("fused_linear_cross_entropy",),
                            composed_of=("ce_loss_and_grad",), compose=fused_linear.compose_flce, probe=probe_flce,
                            summary="fused linear + cross-entropy (label smoothing, softcap, z-loss)"))
    TABLE.declare_op(OpSpec("fused_linear_jsd", "user", check_fused_linear_jsd,
                            composed_of=("jsd_loss_and_grad",), compose=fused_linear.compose_jsd,
                            probe=probe_fused_linear_jsd,
                            summary="fused linear generalized JSD for distillation"))
    TABLE.declare_op(OpSpec("fused_linear_kl_div", "user", check_fused_linear_kl_div,
                            composed_of=("kl_div_loss_and_grad",), compose=fused_linear.compose_kl_div,
                            probe=probe_fused_linear_kl_div,
                            summary="fused linear KL divergence against explicit target probabilities"))
