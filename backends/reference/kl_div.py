"""Reference kl_div_loss_and_grad: the KL rows of formulas.py, gradient through autograd."""

from liger_dispatch import register_backend

from .formulas import kl_div_rows
from ._support import CAPABILITY, PRIORITY, rows_and_grad_in_place


@register_backend("kl_div_loss_and_grad", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def kl_div_loss_and_grad(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                         log_target=False, grad_scale=None):
    return rows_and_grad_in_place(
        student_logits,
        lambda s: kl_div_rows(s, target, labels, ignore_index=ignore_index, temperature=temperature, eps=eps,
                              log_target=log_target),
        grad_scale,
    )
