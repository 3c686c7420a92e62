"""Reference jsd_loss_and_grad: the JSD rows of formulas.py, gradient through autograd."""

from liger_dispatch import register_backend

from .formulas import jsd_rows
from ._support import CAPABILITY, PRIORITY, rows_and_grad_in_place


@register_backend("jsd_loss_and_grad", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def jsd_loss_and_grad(student_logits, teacher_logits, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0,
                      grad_scale=None):
    return rows_and_grad_in_place(
        student_logits,
        lambda s: jsd_rows(s, teacher_logits, labels, beta=beta, ignore_index=ignore_index, temperature=temperature),
        grad_scale,
    )
