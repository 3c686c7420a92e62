"""Reference ce_loss_and_grad: the cross-entropy rows of formulas.py, gradient through autograd."""

import torch

from liger_dispatch import register_backend

from .formulas import ce_row_stats, ce_rows
from ._support import CAPABILITY, PRIORITY, rows_and_grad_in_place


@register_backend("ce_loss_and_grad", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                     lse_square_scale=0.0, ce_weight=None, row_stats=None):
    if row_stats is not None:  # before the logits turn into their gradient
        with torch.no_grad():
            row_stats.copy_(ce_row_stats(logits, target, ignore_index=ignore_index, softcap=softcap))
    return rows_and_grad_in_place(
        logits,
        lambda z: ce_rows(z, target, ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
                          lse_square_scale=lse_square_scale, ce_weight=ce_weight),
        grad_scale,
    )
