"""Reference ce_loss_and_grad: the cross-entropy rows of formulas.py, gradient through autograd."""

from liger_dispatch import register_backend

from .formulas import ce_rows
from ._support import CAPABILITY, PRIORITY, rows_and_grad_in_place


@register_backend("ce_loss_and_grad", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                     lse_square_scale=0.0):
    return rows_and_grad_in_place(
        logits,
        lambda z: ce_rows(z, target, ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
                          lse_square_scale=lse_square_scale),
        grad_scale,
    )
