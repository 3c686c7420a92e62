"""Hugging Face's causal-LM loss (`ForCausalLMLoss`) from the final hidden states, through `flce`: the target of
position t is labels[t + 1] (none at the last), `ignore_index` rows count for nothing, and the loss is the mean over
the others or, with `num_items_in_batch`, their sum divided by that count (so the micro-batches of a gradient
accumulation step add up to the whole batch's mean). The logits are never made; the math is in fp32 from the
logits on, as HF's `.float()` gives.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch

from liger_dispatch import dispatch


def next_token_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """labels [..., T] -> each position's target: labels[..., t + 1], and ignore_index at the last position."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def linear_inputs(*tensors: Optional[torch.Tensor]):
    """(tensors, context) for running a head outside autocast as F.linear would inside it: in an autocast region
    the floating tensors are cast to its dtype (so the GEMMs run there, as the unpatched lm_head's would) and the
    op runs with autocast off (its own GEMMs write into preallocated buffers)."""
    device_type = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors, contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    cast = tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)
    return cast, torch.autocast(device_type, enabled=False)


def per_item(loss_sum: torch.Tensor, num_items_in_batch: Union[int, torch.Tensor]) -> torch.Tensor:
    """A summed loss divided by the batch's item count (an int or a tensor on any device), as transformers does."""
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss_sum.device)
    return loss_sum / num_items_in_batch


def causal_lm_loss(hidden_states: torch.Tensor, weight: torch.Tensor, labels: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, *, shift_labels: Optional[torch.Tensor] = None,
                   num_items_in_batch: Union[None, int, torch.Tensor] = None, ignore_index: int = -100,
                   softcap: Optional[float] = None, backend: Optional[str] = None,
                   return_token_accuracy: bool = False):
    """transformers' ForCausalLMLoss of `hidden_states @ weight.T (+ bias)` (then softcap), without the logits.

    Args:
        hidden_states: [..., T, H] the final hidden states (what the lm_head sees).
        weight: [V, H] the lm_head weight; bias: [V] or None.
        labels: [..., T] unshifted labels (shifted here, as HF does); or give `shift_labels` already aligned with
            the positions (HF's `shift_labels`, for packed or sequence-parallel batches).
        num_items_in_batch: when given, the summed loss divided by it (exact gradient accumulation).
        softcap: Gemma's final_logit_softcapping: logits = softcap * tanh(logits / softcap).
        backend: pins the flce backend; None follows `use_backend`, LIGER_BACKEND_FLCE, LIGER_BACKEND, auto.
        return_token_accuracy: also the fraction of the positions with a target whose target's logit is the max
            (liger-kernel's token accuracy; a tie counts as predicted), without a gradient.
    Returns:
        the scalar loss (fp32 math), or with return_token_accuracy a CrossEntropyOutput(loss, None, token_accuracy).
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss needs labels or shift_labels")
        shift_labels = next_token_targets(labels, ignore_index)
    target = shift_labels.reshape(-1).to(hidden_states.device)
    (x, weight, bias), context = linear_inputs(hidden_states.reshape(-1, hidden_states.shape[-1]), weight, bias)
    flce = dispatch.op("flce", backend=backend)
    reduction = "mean" if num_items_in_batch is None else "sum"
    with context:
        out = flce(x, weight, target, bias, ignore_index=ignore_index, reduction=reduction, softcap=softcap,
                   return_token_accuracy=return_token_accuracy)
    loss = out.loss if return_token_accuracy else out
    if num_items_in_batch is not None:
        loss = per_item(loss, num_items_in_batch)
    return out._replace(loss=loss) if return_token_accuracy else loss
