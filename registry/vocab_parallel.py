"""Op specs of the vocab-parallel kernel-level ops (their contract is written once, in SCHEMAS, and the docstring below).

A rank holds the logits of the columns [vocab_start, vocab_start + Vl) of a vocabulary of V. A statistics pass
returns fp32 per-row statistics over this slice; the driver (liger_dispatch/compose/vocab_parallel.py) combines them
over the ranks (log-sum-exp for the lse columns, sums for the others); a gradient pass takes the global
statistics and writes this slice's gradient over the logits. Rows whose label is ignore_index give zero
statistics and a zero gradient; an empty slice (Vl = 0) has lse -inf.
"""

from __future__ import annotations

import torch

from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks as c
from liger_dispatch.registry.losses import fake_rows
from liger_dispatch.core.table import TABLE, OpSpec

SCHEMAS = {
    "ce_vp_stats": "ce_vp_stats(Tensor logits, Tensor target, *, int vocab_start=0, int ignore_index=-100, "
                   "float? softcap=None) -> Tensor",
    "ce_vp_grad": "ce_vp_grad(Tensor(a!) logits, Tensor target, Tensor lse, *, int vocab_start=0, int vocab_size=0, "
                  "Tensor? grad_scale=None, int ignore_index=-100, float label_smoothing=0.0, float? softcap=None, "
                  "float lse_square_scale=0.0) -> ()",
    "jsd_vp_stats": "jsd_vp_stats(Tensor student_logits, Tensor teacher_logits, Tensor? labels=None, *, "
                    "int ignore_index=-100, float temperature=1.0) -> Tensor",
    "jsd_vp_sums": "jsd_vp_sums(Tensor student_logits, Tensor teacher_logits, Tensor lse, Tensor? labels=None, *, "
                   "float beta=0.5, int ignore_index=-100, float temperature=1.0) -> Tensor",
    "jsd_vp_grad": "jsd_vp_grad(Tensor(a!) student_logits, Tensor teacher_logits, Tensor lse, Tensor sums, "
                   "Tensor? labels=None, *, float beta=0.5, int ignore_index=-100, float temperature=1.0, "
                   "Tensor? grad_scale=None) -> ()",
    "kl_div_vp_stats": "kl_div_vp_stats(Tensor student_logits, Tensor target, Tensor? labels=None, *, "
                       "int ignore_index=-100, float temperature=1.0, float eps=1e-10, bool log_target=False) -> Tensor",
    "kl_div_vp_grad": "kl_div_vp_grad(Tensor(a!) student_logits, Tensor target, Tensor lse, Tensor target_sum, "
                      "Tensor? labels=None, *, int ignore_index=-100, float temperature=1.0, bool log_target=False, "
                      "Tensor? grad_scale=None) -> ()",
}


def _logits(name, logits):
    """A [C, Vl] slice of logits (Vl may be 0); returns C."""
    c.tensor(name, logits, ndim=2, floating=True)
    c.last_dim_contiguous(name, logits)
    return logits.shape[0]


def _same_shape(name, t, ref_name, ref):
    c.tensor(name, t, ndim=2, floating=True)
    c.last_dim_contiguous(name, t)
    if t.shape != ref.shape:
        raise InputError(f"{name} has shape {tuple(t.shape)} but {ref_name} has {tuple(ref.shape)}")


def _labels(name, labels, n):
    if labels is not None:
        c.tensor(name, labels, ndim=1, integer=True)
        c.rows(name, labels.numel(), n, "number of labels")


def _row_stats(name, stats, n, columns):
    """Per-row fp32 statistics: [C] when columns is None, else [C, columns]."""
    c.tensor(name, stats)
    shape = (n,) if columns is None else (n, columns)
    if stats.dtype not in (torch.float32, torch.float64) or tuple(stats.shape) != shape:
        raise InputError(f"{name} must be float32 of shape {list(shape)}, got {stats.dtype} {tuple(stats.shape)}")


def check_ce_vp_stats(a):
    n = _logits("logits", a.logits)
    _labels("target", a.target, n)
    c.same_device(logits=a.logits, target=a.target)
    c.integer("vocab_start", a.vocab_start)
    c.non_negative("vocab_start", a.vocab_start)
    c.integer("ignore_index", a.ignore_index)
    if a.softcap is not None:
        c.positive("softcap", a.softcap)


def check_ce_vp_grad(a):
    check_ce_vp_stats(a)
    n = a.logits.shape[0]
    _row_stats("lse", a.lse, n, None)
    c.same_device(logits=a.logits, lse=a.lse, grad_scale=a.grad_scale)
    c.grad_scale(a.grad_scale, n)
    c.integer("vocab_size", a.vocab_size)
    if a.vocab_size != 0 and a.vocab_size < a.vocab_start + a.logits.shape[1]:
        raise InputError(f"vocab_size is {a.vocab_size} but the slice ends at column {a.vocab_start + a.logits.shape[1]}")
    c.in_range("label_smoothing", a.label_smoothing, 0.0, 1.0)
    c.non_negative("lse_square_scale", a.lse_square_scale)


def _student_and(a, other: str) -> int:
    """student_logits [C, Vl], `other` of the same shape (the teacher's logits, the KL target), the labels and the
    options every JSD / KL op has; returns C."""
    n = _logits("student_logits", a.student_logits)
    _same_shape(other, getattr(a, other), "student_logits", a.student_logits)
    _labels("labels", a.labels, n)
    c.same_device(student_logits=a.student_logits, **{other: getattr(a, other)}, labels=a.labels)
    c.positive("temperature", a.temperature)
    c.integer("ignore_index", a.ignore_index)
    return n


def check_jsd_vp_stats(a):
    _student_and(a, "teacher_logits")


def check_jsd_vp_sums(a):
    check_jsd_vp_stats(a)
    _row_stats("lse", a.lse, a.student_logits.shape[0], 2)
    c.same_device(student_logits=a.student_logits, lse=a.lse)
    c.in_range("beta", a.beta, 0.0, 1.0)


def check_jsd_vp_grad(a):
    check_jsd_vp_sums(a)
    n = a.student_logits.shape[0]
    _row_stats("sums", a.sums, n, 2)
    c.same_device(student_logits=a.student_logits, sums=a.sums, grad_scale=a.grad_scale)
    c.grad_scale(a.grad_scale, n)


def check_kl_div_vp_stats(a):
    _student_and(a, "target")
    c.non_negative("eps", a.eps)


def check_kl_div_vp_grad(a):
    n = _student_and(a, "target")
    _row_stats("lse", a.lse, n, None)
    _row_stats("target_sum", a.target_sum, n, None)
    c.same_device(student_logits=a.student_logits, lse=a.lse, target_sum=a.target_sum, grad_scale=a.grad_scale)
    c.grad_scale(a.grad_scale, n)


def _fake_stats(columns):
    """A statistics pass's output: [C, columns]."""
    return lambda a: fake_rows(a, columns)


def _fake_in_place(a):
    """A gradient pass returns nothing: it writes its first argument."""
    return None


SUMMARIES = {
    "ce_vp_stats": "vocab-parallel CE: a slice's row stats (lse, target logit, sum)",
    "ce_vp_grad": "vocab-parallel CE: a slice's gradient from the global lse",
    "jsd_vp_stats": "vocab-parallel JSD: a slice's lse of student and teacher",
    "jsd_vp_sums": "vocab-parallel JSD: a slice's part of the loss and cross term",
    "jsd_vp_grad": "vocab-parallel JSD: a slice's gradient from the global stats",
    "kl_div_vp_stats": "vocab-parallel KL: a slice's row stats (lse, q, q log q, q s)",
    "kl_div_vp_grad": "vocab-parallel KL: a slice's gradient from the global stats",
}

CHECKS = {
    "ce_vp_stats": (check_ce_vp_stats, _fake_stats(3)), "ce_vp_grad": (check_ce_vp_grad, _fake_in_place),
    "jsd_vp_stats": (check_jsd_vp_stats, _fake_stats(2)), "jsd_vp_sums": (check_jsd_vp_sums, _fake_stats(2)),
    "jsd_vp_grad": (check_jsd_vp_grad, _fake_in_place),
    "kl_div_vp_stats": (check_kl_div_vp_stats, _fake_stats(4)), "kl_div_vp_grad": (check_kl_div_vp_grad, _fake_in_place),
}


def declare() -> None:
    for name, schema in SCHEMAS.items():
        check, fake = CHECKS[name]
        TABLE.declare_op(OpSpec(schema, "kernel", check, fake=fake, summary=SUMMARIES[name]))
