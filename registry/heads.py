"""What the LM-head loss families share: checks of an input / weight pair and of a logits chunk, the probes and
fakes of their kernel-level ops, and the implementation parameters of a loss whose gradient is computed in the
forward pass."""

from __future__ import annotations

import math

import torch

from liger_dispatch.compose import fused_linear as fl
from liger_dispatch.core.table import TensorSpec
from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks as c

# What the implementations of a fused-linear loss take beyond its schema: which of the op's `differentiable`
# tensors need their gradient (computed in the forward pass), and, for a loss per row, per-row weights of the
# loss (the backward of reduction="none" is the gradient of sum_i w_i loss_i).
NEED_GRADS = "bool[] need_grads=[]"
ROW_WEIGHTS = "Tensor? row_weights=None"
# ... and, traced by torch.compile, the logits' gradient [N, V] in place of the weight's (OpSpec.logits_grad)
LOGITS_GRAD = "bool logits_grad=False"


def head(input_name, input, weight_name, weight):
    """Checks an LM-head pair input [..., H] / weight [V, H]; returns (N, V)."""
    c.tensor(input_name, input, min_ndim=1, floating=True)
    c.tensor(weight_name, weight, ndim=2, floating=True)
    c.same_dtype(input_name, input, weight_name, weight)
    if weight.shape[1] != input.shape[-1] == weight.shape[0]:
        raise InputError(f"{weight_name} has shape {tuple(weight.shape)} but must be [V, H] (vocabulary, hidden; "
                         f"{input_name}'s H is {input.shape[-1]}), as lm_head.weight is: was it passed transposed?")
    c.dim_equals(input_name, input.shape[-1], weight.shape[1], "hidden size (last dim)", f"{weight_name}'s dim 1")
    if input.shape[-1] == 0:
        raise InputError(f"{input_name} has shape {tuple(input.shape)}: its hidden size (last dim) is 0")
    return input.shape[:-1].numel(), weight.shape[0]


def keeps_logits_grad(input, weight, accum_dtype, process_group, extra_bytes_per_logit=0) -> bool:
    """OpSpec.logits_grad of an LM-head loss: fused_linear.keeps_whole_grad, without an fp16 gradient factor or a
    wider accumulator, on one rank."""
    if input.dtype == torch.float16 or accum_dtype not in (None, weight.dtype) or process_group is not None:
        return False
    rows = math.prod(input.shape[:-1])  # not Size.numel(): it specializes a symbolic N (torch.compile, dynamic)
    return fl.keeps_whole_grad(rows, weight.shape[0], input.element_size(), extra_bytes_per_logit,
                               weight.shape[1] * weight.element_size())


def accum_dtype(value):
    if value not in (None, torch.float32):
        raise InputError(f"accum_dtype must be None (the weight's dtype) or torch.float32, got {value!r}")


def bias(name, value, vocab, input_name, input):
    """An optional bias [V] of an LM head of V classes, in the input's dtype (as F.linear takes it)."""
    if value is not None:
        c.tensor(name, value, ndim=1, floating=True)
        c.dim_equals(name, value.shape[0], vocab, "length")
        c.same_dtype(input_name, input, name, value)


def target_classes(a):
    """The class-index check of an LM head's `target`: it needs the values, so it runs where the op runs. With a
    process_group the weight is a slice: the composition checks against the whole vocabulary."""
    if a.process_group is None:
        c.class_indices("target", a.target, a.weight.shape[0], a.ignore_index)


def labels(name, value, n):
    """Optional labels of a [C, V] chunk: an integer tensor [C]."""
    if value is None:
        return
    c.tensor(name, value, ndim=1, integer=True)
    c.rows(name, value.numel(), n, "number of labels")


def row_labels(name, value, input_name, input):
    """Optional labels of a user-level op's input [..., H]: an integer tensor of its leading shape, or that
    flattened (checks.leading_shape)."""
    if value is None:
        return
    c.tensor(name, value, integer=True)
    c.leading_shape(name, value.shape, input_name, input)


def logits(name, value):
    """A [C, V] chunk of logits (V may be 0: a vocab-parallel rank's empty slice); returns its shape."""
    c.tensor(name, value, ndim=2, floating=True)
    c.last_dim_contiguous(name, value)
    return value.shape


def same_shape(name, value, ref_name, ref):
    logits(name, value)
    if value.shape != ref.shape:
        raise InputError(f"{name} has shape {tuple(value.shape)} but {ref_name} has {tuple(ref.shape)}")


def row_stats(name, stats, n, columns):
    """Per-row fp32 statistics: [C] when columns is None, else [C, columns]."""
    c.tensor(name, stats)
    shape = (n,) if columns is None else (n, columns)
    if stats.dtype not in (torch.float32, torch.float64) or tuple(stats.shape) != shape:
        raise InputError(f"{name} must be float32 of shape {list(shape)}, got {stats.dtype} {tuple(stats.shape)}")


def student_and(other_name, a):
    """The checks a kernel-level op on a student logits chunk and a second [C, V] tensor share; returns C."""
    other = getattr(a, other_name)
    n, _ = logits("student_logits", a.student_logits)
    same_shape(other_name, other, "student_logits", a.student_logits)
    c.same_device(student_logits=a.student_logits, **{other_name: other}, labels=a.labels)
    c.positive("temperature", a.temperature)
    c.integer("ignore_index", a.ignore_index)
    labels("labels", a.labels, n)
    return n


def scaled_student(other_name, a):
    """student_and, and the grad_scale of a kernel-level op that writes the student's gradient; returns C."""
    n = student_and(other_name, a)
    c.grad_scale(a.grad_scale, n)
    c.same_device(student_logits=a.student_logits, grad_scale=a.grad_scale)
    return n


def logits_spec(input, weight):
    """The [rows, V] logits buffer a fused-linear composition makes."""
    return TensorSpec((math.prod(input.shape[:-1]), weight.shape[0]), input.dtype)


def rows_by_last(t):
    """t as the composition flattens it to 2-D, keeping its last dim."""
    return TensorSpec((math.prod(t.shape[:-1]), t.shape[-1]), t.dtype)


def rows_spec(value):
    """Per-row labels as the composition passes them (flattened), or None."""
    return None if value is None else TensorSpec((value.numel(),), value.dtype)


def loss_dtype(t) -> torch.dtype:
    """What a loss computed from t comes out in: fp32, float64 for float64 t (as the reference computes)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def fake_rows(a, *columns: int):
    """A kernel-level op's per-row output [C, *columns] in loss_dtype: the per-row loss, or a pass's per-row
    statistics."""
    chunk = getattr(a, "logits", None)
    chunk = a.student_logits if chunk is None else chunk
    return chunk.new_empty(chunk.shape[0], *columns, dtype=loss_dtype(chunk))


def fake_stats(columns):
    """A statistics pass's output: [C, columns]."""
    return lambda a: fake_rows(a, columns)


def fake_in_place(a):
    """A gradient pass returns nothing: it writes its first argument."""
    return None


def fake_scalar_loss(a):
    return a.student_input.new_empty((), dtype=loss_dtype(a.student_input))
