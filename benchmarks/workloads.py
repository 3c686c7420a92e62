"""What each op does in a benchmark: its random inputs and its minimum work (one call's step: liger_dispatch.timing).

Every provider is called with the project's own signature (DESIGN.md, Ops); peers adapt to it.
Labels carry a few ignored rows so the ignore path is part of what is timed.
"""

from __future__ import annotations

import math

import torch

from benchmarks.shapes import Case
from liger_dispatch.timing import Inputs

IGNORE_INDEX = -100
IGNORED_FRACTION = 0.05
# GEMM FLOPs per N*H*V of the LM-head ops, per pass (fwd: the logits; bwd: grad input and grad weight).
# fused_linear_logprobs: its floor keeps all logits (6 N H V; a recomputed vocabulary column adds 2 N H to the backward)
_GEMM_COEFF = {"flce": (2, 4), "fused_linear_jsd": (4, 4), "fused_linear_kl_div": (2, 4),
               "fused_linear_logprobs": (2, 4)}


def make_inputs(case: Case, device: torch.device, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    return _MAKERS[case.op](case, device, gen)


def work(case: Case, mode: str | None = None) -> tuple[float, float]:
    """(GEMM FLOPs, bytes) at the floor of `mode`: fwd+bwd is the sum of the two passes.

    Bytes count each input read once per pass and each gradient written once (the outputs are
    scalars or, for mHC, about 1% of x): what decides the floor of mHC, negligible for the LM heads.
    """
    mode = mode or case.mode
    if mode == "fwd+bwd":
        return tuple(a + b for a, b in zip(work(case, "fwd"), work(case, "bwd")))
    if case.op in _GEMM_COEFF:
        n, h, v = case.dim("N"), case.dim("H"), case.dim("V")
        fwd, bwd = _GEMM_COEFF[case.op]
        flops = (fwd if mode == "fwd" else bwd) * n * h * v
        itemsize = torch.finfo(case.dtype).bits // 8
        leaves = (n * h + v * h) * itemsize
        inputs = leaves * (2 if case.op == "fused_linear_jsd" else 1)
        if case.op == "fused_linear_kl_div":
            inputs += n * v * itemsize  # the target distribution
        return float(flops), float(inputs if mode == "fwd" else 2 * leaves)
    rows = case.dim("B") * case.dim("T")
    hc = case.dim("HC")
    k, m = hc * case.dim("C"), hc * hc + 2 * hc
    itemsize = torch.finfo(case.dtype).bits // 8
    x_and_phi = (rows * k + k * m) * itemsize
    flops = 2 * rows * k * m * (1 if mode == "fwd" else 2)
    return float(flops), float(x_and_phi if mode == "fwd" else 2 * x_and_phi)


# ---------------------------------------------------------------- input makers


def randn(shape, dtype, device, gen, std=1.0):
    return (torch.randn(shape, dtype=torch.float32, device=device, generator=gen) * std).to(dtype)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.requires_grad_(True)


def _labels(n, vocab, device, gen):
    labels = torch.randint(0, vocab, (n,), device=device, generator=gen)
    ignored = torch.rand(n, device=device, generator=gen) < IGNORED_FRACTION
    return labels.masked_fill_(ignored, IGNORE_INDEX)


def lm_head(case, device, gen):
    """input [N, H] ~ N(0, 1), weight [V, H] ~ N(0, 1/H): logits of unit scale."""
    n, h, v = case.dim("N"), case.dim("H"), case.dim("V")
    return randn((n, h), case.dtype, device, gen), randn((v, h), case.dtype, device, gen, h ** -0.5)


def _flce(case, device, gen):
    x, w = lm_head(case, device, gen)
    target = _labels(case.dim("N"), case.dim("V"), device, gen)
    return Inputs((leaf(x), leaf(w), target), {"ignore_index": IGNORE_INDEX, "reduction": "mean"}, [x, w])


def _jsd(case, device, gen):
    x, w = lm_head(case, device, gen)
    xt, wt = lm_head(case, device, gen)
    labels = _labels(case.dim("N"), case.dim("V"), device, gen)
    kwargs = {"jsd_beta": 0.5, "ignore_index": IGNORE_INDEX, "temperature": 1.0}
    return Inputs((leaf(x), leaf(w), xt, wt, labels), kwargs, [x, w])


def _kl(case, device, gen):
    x, w = lm_head(case, device, gen)
    n, v = case.dim("N"), case.dim("V")
    target = torch.empty((n, v), dtype=case.dtype, device=device)
    for start in range(0, n, 2048):  # bounds the fp32 temporary at large N x V
        rows = target[start:start + 2048]
        rows.copy_(torch.softmax(randn(rows.shape, torch.float32, device, gen, 2.0), dim=-1))
    labels = _labels(n, v, device, gen)
    kwargs = {"reduction": "batchmean", "ignore_index": IGNORE_INDEX, "temperature": 1.0}
    return Inputs((leaf(x), leaf(w), target, labels), kwargs, [x, w])


def _logprobs(case, device, gen):
    """The RL setting: random upstream gradients on both outputs (logprobs and entropy), temperature 0.9."""
    x, w = lm_head(case, device, gen)
    n = case.dim("N")
    target = _labels(n, case.dim("V"), device, gen)
    upstream = (randn((n,), torch.float32, device, gen), randn((n,), torch.float32, device, gen))
    return Inputs((leaf(x), leaf(w), target), {"ignore_index": IGNORE_INDEX, "temperature": 0.9}, [x, w], upstream)


def _mhc(case, device, gen):
    """What a model feeds the op: x [B, T, HC, C] contiguous (the residual stream), phi in the model dtype."""
    b, t, hc, c = (case.dim(k) for k in ("B", "T", "HC", "C"))
    k, m = hc * c, hc * hc + 2 * hc
    x = randn((b, t, hc, c), case.dtype, device, gen)
    phi = randn((k, m), case.dtype, device, gen, 1 / math.sqrt(k))
    bias = randn((m,), torch.float32, device, gen, 0.1)
    alphas = [0.5 + torch.rand((), device=device, generator=gen) for _ in range(3)]
    leaves = [leaf(x), leaf(phi), leaf(bias), *map(leaf, alphas)]
    upstream = (randn((b, t, hc), torch.float32, device, gen), randn((b, t, hc), torch.float32, device, gen),
                randn((b, t, hc, hc), torch.float32, device, gen))
    return Inputs(tuple(leaves), {}, leaves, upstream)


_MAKERS = {"flce": _flce, "fused_linear_jsd": _jsd, "fused_linear_kl_div": _kl, "fused_linear_logprobs": _logprobs,
           "mhc_coeffs": _mhc}
