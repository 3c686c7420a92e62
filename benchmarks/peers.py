"""Adapters from the project's signatures (DESIGN.md, Ops) to the peer libraries'.

Each adapter sets the peer's options so it computes the same function as ours, and raises
Unsupported for an option the peer lacks rather than timing something else.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from benchmarks.shapes import MODEL_OPS


class Unsupported(Exception):
    """The peer has no equivalent of this call (an option, a dtype, a shape)."""


def _no(option: str, peer: str) -> Unsupported:
    return Unsupported(f"{peer} has no {option}")


def _reject_set(peer: str, **is_set: bool) -> None:
    """Raise Unsupported for the first option the call sets away from its default."""
    for option, value in is_set.items():
        if value:
            raise _no(option, peer)


# ---------------------------------------------------------------- liger-kernel


def _liger(op: str) -> Callable:
    if op == "flce":
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        def flce(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 softcap=None, lse_square_scale=0.0):
            loss = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, lse_square_scale=lse_square_scale,
                                                    label_smoothing=label_smoothing, reduction=reduction,
                                                    softcap=softcap)
            return loss(weight, input, target, bias)  # Liger takes the weight first

        return flce
    if op == "fused_linear_jsd":
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

        # Liger 0.8.5's beta matches ours (0: KL(teacher||student), 1: KL(student||teacher),
        # else beta*KL(p||m) + (1-beta)*KL(q||m) with m = beta*p + (1-beta)*q), and it divides the
        # logits by T without the T^2 factor, as ours does by default.
        def jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None, *, jsd_beta=0.5,
                ignore_index=-100, temperature=1.0, scale_by_temperature_squared=False):
            loss = LigerFusedLinearJSD(jsd_beta=jsd_beta, ignore_index=ignore_index, temperature=temperature)(
                student_input, student_weight, teacher_input, teacher_weight, shift_labels)
            return loss * temperature**2 if scale_by_temperature_squared else loss

        return jsd
    if op == "fused_linear_kl_div":
        from liger_kernel.transformers.fused_linear_kl_div import LigerFusedLinearKLDivLoss

        def kl_div(student_input, student_weight, target, shift_labels=None, *, reduction="batchmean",
                   ignore_index=-100, temperature=1.0, eps=1e-10, log_target=False):
            if log_target:
                raise _no("log_target (it takes probabilities)", "liger-kernel's fused linear KL")
            loss = LigerFusedLinearKLDivLoss(reduction=reduction, ignore_index=ignore_index, temperature=temperature,
                                             eps=eps)
            return loss(student_input, student_weight, target, shift_labels)

        return kl_div
    if op == "mhc_coeffs":
        from liger_kernel.transformers.functional import liger_mhc_coeffs

        def mhc(x, phi, b, alpha_pre, alpha_post, alpha_res, *, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                sinkhorn_eps=1e-6, post_mult=2.0):
            return liger_mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, allow_fp32=x.dtype == torch.float32,
                                    tmax=tmax, rms_eps=rms_eps, pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps,
                                    post_mult=post_mult)

        return mhc
    raise KeyError(op)


# ---------------------------------------------------------------- cut-cross-entropy


def _cce(op: str) -> Callable:
    from cut_cross_entropy import linear_cross_entropy

    def flce(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
             softcap=None, lse_square_scale=0.0):
        _reject_set("cut-cross-entropy", bias=bias is not None, label_smoothing=label_smoothing != 0,
                    lse_square_scale=lse_square_scale != 0)
        # filter_eps=None: exact gradients (its default skips small softmax entries, an approximation).
        return linear_cross_entropy(input, weight, target, ignore_index=ignore_index, softcap=softcap,
                                    reduction=reduction, filter_eps=None, impl="cce")

    return flce


# ---------------------------------------------------------------- quack


def _quack(op: str) -> Callable:
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    def flce(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
             softcap=None, lse_square_scale=0.0):
        _reject_set("quack's linear cross-entropy", bias=bias is not None, label_smoothing=label_smoothing != 0,
                    softcap=softcap is not None, lse_square_scale=lse_square_scale != 0)
        if reduction not in ("mean", "sum"):
            raise _no(f"reduction={reduction!r} in its fused path", "quack")
        # The conditions under which quack's own LinearCrossEntropy module takes its fused, chunked path.
        if input.shape[0] % 8 or input.shape[1] % 8 or weight.shape[0] % 8 or input.stride(-1) != 1:
            raise Unsupported("quack's fused path needs N, H and V multiples of 8")
        return chunked_linear_cross_entropy(input, weight, target, chunk_size=4096, ignore_index=ignore_index,
                                            reduction=reduction)

    return flce


@dataclass(frozen=True)
class Peer:
    distribution: str
    module: str  # imported to tell whether it is installed
    ops: tuple[str, ...]
    adapter: Callable[[str], Callable]  # op -> the peer's implementation with our signature


PEERS = {
    "liger-kernel": Peer("liger-kernel", "liger_kernel", MODEL_OPS, _liger),
    "cut-cross-entropy": Peer("cut-cross-entropy", "cut_cross_entropy", ("flce",), _cce),
    "quack": Peer("quack-kernels", "quack", ("flce",), _quack),
}


def unavailable(name: str, device: torch.device) -> Optional[str]:
    """Why peer `name` cannot run here ("not installed: ...", "needs a CUDA device"), or None."""
    try:
        importlib.import_module(PEERS[name].module)
    except Exception as exc:  # a broken install is as good as none
        return f"not installed: {type(exc).__name__}: {exc}".splitlines()[0]
    # Liger's Triton kernels also run on CPU tensors under Triton's interpreter; the others need CUDA.
    interpreted = name == "liger-kernel" and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return "needs a CUDA device"
    return None


