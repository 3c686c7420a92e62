"""fp16 gradient buffers: the factor the kernels write d loss / d logits at, from a bound on each row's gradient.

Per-logit gradients (~1/V, times 1/N for a mean) sit below fp16's smallest normal (6e-5) and lose their digits,
so for fp16 inputs the kernels write the gradient times one factor, and the GEMM outputs (dX, dW, db) are scaled
back. The factor follows the data: each op bounds the L1 norm of a row's gradient from its inputs, on the device
(no host sync); that bounds every logit's gradient and, times max |W|, every entry of dX, so the factor brings the
largest possible value to LIMIT and neither the buffer nor dX overflows, however large the gradients get (a
strong z-loss, a low temperature, an unnormalized KL target).

Bounds of sum_j |d loss_i / d u_ij| over the raw logits u (z = u / T, or softcap * tanh(u / softcap)):
- cross-entropy: |1 + 2 lse_square_scale lse| + 1 (p (1 + 2 s lse) minus one-hots weighing 1 in all);
  |lse| <= softcap + log V, or without a softcap max_j |u_ij| + log V.
- JSD, beta < 1: 2 / T (for 0 < beta < 1 the gradient is a - q sum(a) with a = (1 - beta) q log(q / m), whose
  L1 norm is at most 2 / e since m >= (1 - beta) q); beta = 1: a = q log(q / p), so 2 (1/e + max_j -log p_j) / T
  with -log p_j <= range of the teacher's logits / T + log V.
- KL: the gradient is (p sum(q) - q) / T, so 2 sum_j |q_j| / T (q = exp(target) for log-targets).
A logit's magnitude is bounded by |x_i| max_j |w_j| + max |b| (Cauchy-Schwarz), from norms of the inputs.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

LIMIT = 2.0 ** 14  # a quarter of fp16's largest finite value (65504): the largest |value| the buffer or dX holds
TEMP_ELEMENTS = 2 ** 26  # rows are reduced in pieces of at most this many elements (a 256 MB fp32 temporary)
Bound = Union[float, torch.Tensor]  # a number, or one per row [N]


def split_scale(grad_scale: torch.Tensor, row_bound: Bound, weight: torch.Tensor
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(the scale the kernel applies, the scale applied to dX / dW / db afterwards) for an fp16 buffer.

    grad_scale: 0-d or [N] weights of the N > 0 rows; row_bound: a bound of each row's gradient L1 norm."""
    w_max = _norm(weight, math.inf).clamp_min(1.0)
    peak = ((grad_scale.abs() * row_bound).amax() * w_max).clamp_min(1e-30)
    return grad_scale * (LIMIT / peak), peak / LIMIT


def logit_bound(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N] bounds of max_j |x_i . w_j + b_j|."""
    bound = _norm(x, 2, dim=-1) * _norm(weight, 2, dim=1).amax()
    return bound if bias is None else bound + _norm(bias, math.inf)


def ce(x, weight, bias, *, softcap=None, lse_square_scale=0.0) -> Bound:
    if lse_square_scale == 0.0:
        return 2.0
    lse = (softcap if softcap is not None else logit_bound(x, weight, bias)) + math.log(weight.shape[0])
    return 2.0 + 2.0 * lse_square_scale * lse


def jsd(teacher_x, teacher_weight, *, beta, temperature) -> Bound:
    if beta < 1.0:
        return 2.0 / temperature
    neg_log_p = 2.0 * logit_bound(teacher_x, teacher_weight) / temperature + math.log(teacher_weight.shape[0])
    return 2.0 * (1.0 / math.e + neg_log_p) / temperature


def kl_div(target: torch.Tensor, *, temperature, log_target) -> Bound:
    """target: [N, V]."""
    if not log_target:
        mass = _norm(target, 1, dim=-1)
    else:  # sum_j exp(target_ij), row pieces at a time: exp needs a temporary
        step = max(1, TEMP_ELEMENTS // max(1, target.shape[1]))
        mass = torch.cat([torch.logsumexp(t.to(_wide(t)), dim=-1).exp() for t in target.split(step)])
    return 2.0 * mass / temperature


def _wide(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _norm(t: torch.Tensor, order, dim=None) -> torch.Tensor:
    """A vector norm accumulated in fp32 or wider, without a widened copy of t."""
    return torch.linalg.vector_norm(t, order, dim=dim, dtype=_wide(t))
