"""Per-token log-probs and entropy of an LM head, the primitive of RL and preference training: the kernel-level ops.

A chunk of logits [C, Vl] holds the columns [vocab_start, vocab_start + Vl) of a vocabulary (vocab_start = 0 and
Vl = V on one GPU; a vocab-parallel rank passes its slice). With z = logits / T:

    logprobs_stats -> [C, 3] fp32 per row over this slice: (lse = logsumexp_j z_j, z_target = z[target -
        vocab_start] when the target lies in this slice else 0, mean = sum_j softmax(z)_j z_j under this slice's
        own softmax). logprob = z_target - lse, entropy = lse - mean; slices combine as lse = logsumexp_r lse_r,
        z_target = sum_r z_target_r, mean = sum_r exp(lse_r - lse) mean_r (the driver's job;
        backends/reference/formulas.py:combine_logprobs_stats is the formula). An empty slice has lse -inf.
    logprobs_grad  -> overwrites the logits (their own dtype) with d(sum_i g_i logprob_i + h_i entropy_i)/d logits
        from the GLOBAL statistics: (g (1[j + vocab_start == target] - p_j) - h p_j (z_j - mean)) / T,
        p_j = exp(z_j - lse). g = grad_logprobs, h = grad_entropy, [C] fp32; None is 0 and is never read.

Rows whose target is ignore_index: zero statistics and a zero gradient, whatever global statistics come in.
"""

from __future__ import annotations

import torch

from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks as c
from liger_dispatch.core.table import OpSpec
from liger_dispatch.registry.heads import fake_in_place, fake_rows

STATS_SCHEMA = ("logprobs_stats(Tensor logits, Tensor target, *, int vocab_start=0, float temperature=1.0, "
                "int ignore_index=-100) -> Tensor")
GRAD_SCHEMA = ("logprobs_grad(Tensor(a!) logits, Tensor target, Tensor stats, Tensor? grad_logprobs=None, "
               "Tensor? grad_entropy=None, *, int vocab_start=0, float temperature=1.0, int ignore_index=-100) -> ()")
STATS_COLUMNS = 3  # lse, z_target, mean


def _per_row_float(name, t, n, shape):
    """A per-row fp32 tensor (float64 allowed: the reference's gradcheck) of exactly `shape`, any strides."""
    c.tensor(name, t)
    if t.dtype not in (torch.float32, torch.float64) or tuple(t.shape) != shape:
        raise InputError(f"{name} must be float32 of shape {list(shape)} (one value per row of the {n} rows of "
                         f"logits), got {t.dtype} {tuple(t.shape)}")


def check_logprobs_stats(a):
    c.tensor("logits", a.logits, ndim=2, floating=True)  # [C, Vl], Vl may be 0 (an empty slice)
    c.last_dim_contiguous("logits", a.logits)
    n = a.logits.shape[0]
    c.tensor("target", a.target, ndim=1, integer=True)
    c.rows("target", a.target.numel(), n, "number of targets")
    c.same_device(logits=a.logits, target=a.target)
    c.integer("vocab_start", a.vocab_start)
    c.non_negative("vocab_start", a.vocab_start)
    c.positive("temperature", a.temperature)
    c.integer("ignore_index", a.ignore_index)


def check_logprobs_grad(a):
    check_logprobs_stats(a)
    n = a.logits.shape[0]
    _per_row_float("stats", a.stats, n, (n, STATS_COLUMNS))
    for name in ("grad_logprobs", "grad_entropy"):
        if getattr(a, name) is not None:
            _per_row_float(name, getattr(a, name), n, (n,))
    c.same_device(logits=a.logits, stats=a.stats, grad_logprobs=a.grad_logprobs, grad_entropy=a.grad_entropy)


def fake_stats(a):
    """[C, 3] fp32 (float64 for float64 logits, as the reference computes)."""
    return fake_rows(a, STATS_COLUMNS)


OPS = (
    OpSpec(STATS_SCHEMA, "kernel", check_logprobs_stats, fake=fake_stats,
           summary="per-token log-probs / entropy: a logits slice's row stats (lse, z_target, mean z)"),
    OpSpec(GRAD_SCHEMA, "kernel", check_logprobs_grad, fake=fake_in_place,
           summary="per-token log-probs / entropy: the gradient over the logits from global stats"),
)
BACKEND_MODULES = {"logprobs_stats": "logprobs", "logprobs_grad": "logprobs"}
