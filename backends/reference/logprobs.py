"""Reference logprobs_stats and logprobs_grad (registry/logprobs.py): the statistics and the closed-form gradient of
formulas.py in eager torch, fp32 (float64 for float64 logits). The gradient is written out analytically: it depends
on the whole vocabulary's statistics, which autograd of one slice cannot see; tests check it against autograd of
formulas.logprobs_rows."""

import torch

from liger_dispatch import register_backend

from . import formulas
from ._support import CAPABILITY, PRIORITY


@register_backend("logprobs_stats", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def logprobs_stats(logits, target, *, vocab_start=0, temperature=1.0, ignore_index=-100):
    """[C, 3] per row of this slice: (lse, z_target where this slice holds the target else 0, mean z)."""
    return formulas.logprobs_stats(logits, target, vocab_start=vocab_start, temperature=temperature,
                                   ignore_index=ignore_index)


@register_backend("logprobs_grad", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def logprobs_grad(logits, target, stats, grad_logprobs=None, grad_entropy=None, *, vocab_start=0, temperature=1.0,
                  ignore_index=-100):
    """Overwrites this slice's logits with d(sum g logprobs + h entropy)/d logits under the global stats [C, 3]."""
    grad = formulas.logprobs_grad(logits, target, stats, grad_logprobs, grad_entropy, vocab_start=vocab_start,
                                  temperature=temperature, ignore_index=ignore_index)
    with torch.no_grad():
        logits.copy_(grad)
