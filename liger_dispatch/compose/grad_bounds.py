"""fp16 gradient buffers: the factor the kernels write d loss / d logits at, from a bound on each row's gradient.

Per-logit gradients (~1/V, times 1/N for a mean) fall below fp16's smallest normal (6e-5) and lose their digits, so
for fp16 inputs the kernels write the gradient times one factor and dX, dW, db are scaled back. Each op family
bounds the L1 norm of a row's gradient from its inputs on the device (its grad_bound, in registry/; no host sync);
that bounds every logit's gradient and, times max |W|, every entry of dX, so the factor brings the largest possible
value to LIMIT and nothing overflows however large the gradients get (a strong z-loss, a low temperature, an
unnormalized KL target). A logit's magnitude is bounded by |x_i| max_j |w_j| + max |b| (Cauchy-Schwarz).
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
    w_max = norm(weight, math.inf).clamp_min(1.0)
    peak = ((grad_scale.abs() * row_bound).amax() * w_max).clamp_min(1e-30)
    return grad_scale * (LIMIT / peak), peak / LIMIT


def logit_bound(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N] bounds of max_j |x_i . w_j + b_j|."""
    bound = norm(x, 2, dim=-1) * norm(weight, 2, dim=1).amax()
    return bound if bias is None else bound + norm(bias, math.inf)


def wide(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def norm(t: torch.Tensor, order, dim=None) -> torch.Tensor:
    """A vector norm accumulated in fp32 or wider, without a widened copy of t."""
    return torch.linalg.vector_norm(t, order, dim=dim, dtype=wide(t))
