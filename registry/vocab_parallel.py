"""Op specs of the vocab-parallel kernel-level ops (the contract: /work/vp_contract.md, kept in SCHEMAS).

A rank holds the logits of the columns [vocab_start, vocab_start + Vl) of a vocabulary of V. A statistics pass
returns fp32 per-row statistics over this slice; the driver (liger_dispatch/vocab_parallel.py) combines them
over the ranks (log-sum-exp for the lse columns, sums for the others); a gradient pass takes the global
statistics and writes this slice's gradient over the logits. Rows whose label is ignore_index give zero
statistics and a zero gradient; an empty slice (Vl = 0) has lse -inf.
"""

from __future__ import annotations

import torch

from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks as c
from liger_dispatch.table import TABLE, OpSpec

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


def _temperature(temperature, ignore_index):
    c.positive("temperature", temperature)
    c.integer("ignore_index", ignore_index)


def check_ce_vp_stats(logits, target, *, vocab_start=0, ignore_index=-100, softcap=None):
    n = _logits("logits", logits)
    _labels("target", target, n)
    c.same_device(logits=logits, target=target)
    c.integer("vocab_start", vocab_start)
    c.non_negative("vocab_start", vocab_start)
    c.integer("ignore_index", ignore_index)
    if softcap is not None:
        c.positive("softcap", softcap)


def check_ce_vp_grad(logits, target, lse, *, vocab_start=0, vocab_size=0, grad_scale=None, ignore_index=-100,
                     label_smoothing=0.0, softcap=None, lse_square_scale=0.0):
    check_ce_vp_stats(logits, target, vocab_start=vocab_start, ignore_index=ignore_index, softcap=softcap)
    n = logits.shape[0]
    _row_stats("lse", lse, n, None)
    c.same_device(logits=logits, lse=lse, grad_scale=grad_scale)
    c.grad_scale(grad_scale, n)
    c.integer("vocab_size", vocab_size)
    if vocab_size != 0 and vocab_size < vocab_start + logits.shape[1]:
        raise InputError(f"vocab_size is {vocab_size} but the slice ends at column {vocab_start + logits.shape[1]}")
    c.in_range("label_smoothing", label_smoothing, 0.0, 1.0)
    c.non_negative("lse_square_scale", lse_square_scale)


def check_jsd_vp_stats(student_logits, teacher_logits, labels=None, *, ignore_index=-100, temperature=1.0):
    n = _logits("student_logits", student_logits)
    _same_shape("teacher_logits", teacher_logits, "student_logits", student_logits)
    _labels("labels", labels, n)
    c.same_device(student_logits=student_logits, teacher_logits=teacher_logits, labels=labels)
    _temperature(temperature, ignore_index)


def check_jsd_vp_sums(student_logits, teacher_logits, lse, labels=None, *, beta=0.5, ignore_index=-100,
                      temperature=1.0):
    check_jsd_vp_stats(student_logits, teacher_logits, labels, ignore_index=ignore_index, temperature=temperature)
    _row_stats("lse", lse, student_logits.shape[0], 2)
    c.same_device(student_logits=student_logits, lse=lse)
    c.in_range("beta", beta, 0.0, 1.0)


def check_jsd_vp_grad(student_logits, teacher_logits, lse, sums, labels=None, *, beta=0.5, ignore_index=-100,
                      temperature=1.0, grad_scale=None):
    check_jsd_vp_sums(student_logits, teacher_logits, lse, labels, beta=beta, ignore_index=ignore_index,
                      temperature=temperature)
    n = student_logits.shape[0]
    _row_stats("sums", sums, n, 2)
    c.same_device(student_logits=student_logits, sums=sums, grad_scale=grad_scale)
    c.grad_scale(grad_scale, n)


def check_kl_div_vp_stats(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                          log_target=False):
    n = _logits("student_logits", student_logits)
    _same_shape("target", target, "student_logits", student_logits)
    _labels("labels", labels, n)
    c.same_device(student_logits=student_logits, target=target, labels=labels)
    _temperature(temperature, ignore_index)
    c.non_negative("eps", eps)


def check_kl_div_vp_grad(student_logits, target, lse, target_sum, labels=None, *, ignore_index=-100, temperature=1.0,
                         log_target=False, grad_scale=None):
    check_kl_div_vp_stats(student_logits, target, labels, ignore_index=ignore_index, temperature=temperature,
                          log_target=log_target)
    n = student_logits.shape[0]
    _row_stats("lse", lse, n, None)
    _row_stats("target_sum", target_sum, n, None)
    c.same_device(student_logits=student_logits, lse=lse, target_sum=target_sum, grad_scale=grad_scale)
    c.grad_scale(grad_scale, n)


SUMMARIES = {
    "ce_vp_stats": "vocab-parallel CE, per-row statistics of a slice: (lse, target logit, sum of logits)",
    "ce_vp_grad": "vocab-parallel CE gradient of a slice from the global lse, written into the logits",
    "jsd_vp_stats": "vocab-parallel JSD, per-row log-sum-exp of the student's and the teacher's slice",
    "jsd_vp_sums": "vocab-parallel JSD, a slice's part of the row loss and of the gradient's cross term",
    "jsd_vp_grad": "vocab-parallel JSD gradient of a slice from the global statistics, written into the student's",
    "kl_div_vp_stats": "vocab-parallel KL, per-row statistics of a slice: (lse, sum q, sum q log q, sum q s)",
    "kl_div_vp_grad": "vocab-parallel KL gradient of a slice from the global lse and sum q, written into the student's",
}

CHECKS = {
    "ce_vp_stats": check_ce_vp_stats, "ce_vp_grad": check_ce_vp_grad,
    "jsd_vp_stats": check_jsd_vp_stats, "jsd_vp_sums": check_jsd_vp_sums, "jsd_vp_grad": check_jsd_vp_grad,
    "kl_div_vp_stats": check_kl_div_vp_stats, "kl_div_vp_grad": check_kl_div_vp_grad,
}


def declare() -> None:
    for name, check in CHECKS.items():
        TABLE.declare_op(OpSpec(name, "kernel", check, summary=SUMMARIES[name]))
