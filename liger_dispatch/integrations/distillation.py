"""TRL's GKD distillation losses from final hidden states and LM-head weights, without logits.

`generalized_jsd_loss` is TRL's `GKDTrainer.generalized_jsd_loss` (trl/experimental/gkd/gkd_trainer.py) by
`fused_linear_jsd`: q = softmax(student / temperature), p = softmax(teacher / temperature); beta = 0 is KL(p || q),
beta = 1 is KL(q || p), otherwise beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q. TRL's
beta is our `jsd_beta`, endpoints included; no T^2 factor, as in TRL (whose `temperature` is the sampling one).
Positions are TRL's: t counts where labels[t + 1] != ignore_index (without labels, all but each sequence's last);
the loss is their mean, or with `num_items_in_batch` their sum divided by it. `alpha` mixes in hard-label
cross-entropy on the same positions: alpha * CE + (1 - alpha) * divergence. The teacher is never differentiated.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from liger_dispatch import dispatch
from liger_dispatch.integrations.causal_lm import causal_lm_loss, linear_inputs, next_token_targets, per_item


def generalized_jsd_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                         teacher_weight: torch.Tensor, labels: Optional[torch.Tensor] = None, *, beta: float = 0.5,
                         temperature: float = 1.0, alpha: float = 0.0,
                         num_items_in_batch: Union[None, int, torch.Tensor] = None, ignore_index: int = -100,
                         backend: Optional[str] = None) -> torch.Tensor:
    """TRL's generalized JSD between a student's and a teacher's heads (see the module docstring).

    Args:
        student_hidden, teacher_hidden: [..., T, H_s] and [..., T, H_t] final hidden states of the same tokens.
        student_weight, teacher_weight: [V, H_s] and [V, H_t] the lm_head weights (no bias, no softcap).
        labels: [..., T] unshifted labels (-100 where no loss), or None.
        backend: pins the backend of fused_linear_jsd (and of flce when alpha > 0).
    """
    targets = _targets(labels, student_hidden, alpha, ignore_index)
    (xs, ws, xt, wt), context = linear_inputs(student_hidden, student_weight, teacher_hidden, teacher_weight)
    with context:
        divergence = dispatch.op("fused_linear_jsd", backend=backend)(
            xs, ws, xt, wt, targets, jsd_beta=beta, ignore_index=ignore_index, temperature=temperature)
    return _mix_hard_labels(divergence, targets, student_hidden, student_weight, alpha, num_items_in_batch,
                            ignore_index, backend)


def kl_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_probs: torch.Tensor,
            labels: Optional[torch.Tensor] = None, *, temperature: float = 1.0, log_target: bool = False,
            alpha: float = 0.0, num_items_in_batch: Union[None, int, torch.Tensor] = None, ignore_index: int = -100,
            backend: Optional[str] = None) -> torch.Tensor:
    """KL(teacher || softmax(student logits / T)) against explicit teacher probabilities, by fused_linear_kl_div.

    For a teacher known only by its distributions (stored offline, served elsewhere). teacher_probs is
    [..., T, V], aligned with the hidden states' positions (log-probabilities with log_target=True). With
    teacher_probs = softmax(teacher_logits / T) this is generalized_jsd_loss with beta = 0; when the teacher's
    head is at hand, that one never materializes the teacher's distributions.
    """
    targets = _targets(labels, student_hidden, alpha, ignore_index)
    (x, w), context = linear_inputs(student_hidden, student_weight)
    with context:
        divergence = dispatch.op("fused_linear_kl_div", backend=backend)(
            x, w, teacher_probs, targets, ignore_index=ignore_index, temperature=temperature, log_target=log_target)
    return _mix_hard_labels(divergence, targets, student_hidden, student_weight, alpha, num_items_in_batch,
                            ignore_index, backend)


def _targets(labels: Optional[torch.Tensor], hidden: torch.Tensor, alpha: float, ignore_index: int) -> torch.Tensor:
    """Next-token targets [..., T]; without labels, 0 everywhere but ignore_index at each sequence's last position."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if labels is None:
        if alpha > 0.0:
            raise ValueError(f"alpha={alpha} mixes in a hard-label loss and needs labels")
        labels = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
    return next_token_targets(labels, ignore_index)


def _mix_hard_labels(divergence, targets, student_hidden, student_weight, alpha, num_items_in_batch, ignore_index,
                     backend):
    """alpha * CE + (1 - alpha) * divergence, both means over the positions or sums over num_items_in_batch."""
    if num_items_in_batch is not None:  # the op's mean times its row count is the sum
        divergence = per_item(divergence * (targets != ignore_index).sum().clamp_min(1), num_items_in_batch)
    if alpha == 0.0:
        return divergence
    ce = causal_lm_loss(student_hidden, student_weight, shift_labels=targets, num_items_in_batch=num_items_in_batch,
                        ignore_index=ignore_index, backend=backend)
    return alpha * ce + (1.0 - alpha) * divergence
