"""RL and preference training over `fused_linear_logprobs`: per-token log-probs and entropy of a causal LM for given
tokens without its logits, and TRL 1.16's GRPO and DPO losses on top of them in plain PyTorch (written from
trl/trainer/grpo_trainer.py and dpo_trainer.py `_compute_loss`, tested against them in tests/test_rl_integration.py).

    logps, entropy = per_token_logps_and_entropy(model, input_ids, attention_mask, logits_to_keep, temperature=0.9)
    loss = grpo_loss(logps, old_logps, advantages, completion_mask, loss_type="dapo")
    loss = dpo_sigmoid_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=0.1)

A GRPOTrainer subclass trains through the op (text-only models, no MoE aux loss; unwrap an accelerate-wrapped model
first if your setup wraps it):

    class FusedGRPOTrainer(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):
            logps, entropy = per_token_logps_and_entropy(model, input_ids, attention_mask, logits_to_keep,
                                                         temperature=self.temperature)
            return logps, (entropy if compute_entropy else None), None
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from liger_dispatch import dispatch
from liger_dispatch.integrations.causal_lm import next_token_targets
from liger_dispatch.integrations.transformers import final_hidden_states, lm_head_without_softcap

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def per_token_logps_and_entropy(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                                logits_to_keep: int = 0, *, temperature: float = 1.0, backend: Optional[str] = None,
                                **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T)[next token] and the entropy of softmax(logits / T) at each position of a causal LM,
    from its final hidden states (the logits are never made).

    Args:
        input_ids, attention_mask: [B, T]; a position whose next token is masked out gives 0 in both.
        logits_to_keep: score only the last K tokens (TRL's completion), 0: every token after the first.
        inputs: the model's other forward keywords.
    Returns:
        (logps, entropy), fp32 [B, K] (K = T - 1 for logits_to_keep = 0): position k scores token k + 1 of those
        kept, as TRL's per-token log-probs do.
    """
    weight, bias = lm_head_without_softcap(model, "model")
    hidden = final_hidden_states(model, input_ids=input_ids, attention_mask=attention_mask, **inputs)
    labels = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, -100)
    targets = next_token_targets(labels)
    keep = logits_to_keep or input_ids.shape[1] - 1
    hidden, targets = hidden[:, -keep - 1:-1], targets[:, -keep - 1:-1]
    op = dispatch.op("fused_linear_logprobs", backend=backend)
    return op(hidden, weight, targets.to(hidden.device), bias, temperature=temperature)


def grpo_loss(per_token_logps: torch.Tensor, old_per_token_logps: Optional[torch.Tensor], advantages: torch.Tensor,
              completion_mask: torch.Tensor, *, ref_per_token_logps: Optional[torch.Tensor] = None, beta: float = 0.0,
              epsilon: float = 0.2, epsilon_high: Optional[float] = None, loss_type: str = "dapo",
              importance_sampling_level: str = "token", max_completion_length: Optional[int] = None,
              num_items_in_batch: Union[None, int, torch.Tensor] = None) -> torch.Tensor:
    """TRL 1.16's GRPO objective from per-token log-probs [B, T]: the clipped importance ratio (per token or per
    sequence) times the advantages, plus beta times the k3 estimate of the KL to the reference model's log-probs,
    reduced as `loss_type` says. TRL divides grpo / bnpo / dr_grpo by its gradient accumulation steps and rescales
    dapo's num_items_in_batch by its processes and steps: pass what it would.

    old_per_token_logps: the sampling policy's (None: this one's, detached: ratio 1, TRL's num_iterations = 1).
    advantages: [B] or [B, T]. completion_mask: [B, T], 1 for the tokens that count."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(GRPO_LOSS_TYPES)}, got {loss_type!r}")
    mask = completion_mask.to(per_token_logps.dtype)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = per_token_logps - old
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif importance_sampling_level != "token":
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high))
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta != 0 needs ref_per_token_logps")
        delta = ref_per_token_logps - per_token_logps
        per_token_loss = per_token_loss + beta * (torch.exp(delta) - delta - 1)
    masked = per_token_loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else mask.shape[1]
        return masked.sum() / (per_token_loss.size(0) * length)
    count = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=mask.device)
    return masked.sum() / count.clamp(min=1.0)


def dpo_sigmoid_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
                     ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, label_smoothing: float = 0.0
                     ) -> torch.Tensor:
    """The sigmoid DPO loss from summed sequence log-probs [B] of the policy and the reference model
    (label_smoothing 0: TRL 1.16's "sigmoid"; > 0: the conservative DPO of earlier TRL releases)."""
    delta = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    loss = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
    if label_smoothing:
        loss = loss - label_smoothing * F.logsigmoid(-beta * delta)
    return loss.mean()


def sequence_logps(per_token_logps: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B]: the summed log-probs of each sequence's tokens (those of mask, when given), DPO's input."""
    return (per_token_logps if mask is None else per_token_logps * mask.to(per_token_logps.dtype)).sum(-1)
