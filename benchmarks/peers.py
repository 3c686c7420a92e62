"""Adapters from the project's signatures (DESIGN.md, Ops) to the peer libraries'.

Each adapter sets the peer's options so it computes the same function as ours, and raises
Unsupported for an option the peer lacks rather than timing something else.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
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


# ---------------------------------------------------------------- verl


def _verl_device() -> types.ModuleType:
    """verl.utils.device as kernels.py uses it, on torch.cuda (verl's own asks its platform plugins)."""
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()  # a value, not a function, as in verl
    device.get_device_name = lambda: "cuda" if torch.cuda.is_available() else "cpu"
    device.get_torch_device = lambda: torch.cuda
    device.get_device_capability = lambda device_id=0: (
        torch.cuda.get_device_capability(device_id) if torch.cuda.is_available() else (None, None))
    return device


def _empty_package(name: str, folder: Path) -> types.ModuleType:
    """A package that runs no __init__ but finds its submodules in `folder`."""
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    return importlib.util.module_from_spec(spec)


def _load_verl() -> types.ModuleType:
    """verl's fused log-prob kernel, verl/utils/kernel/linear_cross_entropy.py and its kernels.py, from the installed
    files. `import verl` needs verl's whole runtime (ray, ...), so unless it is already imported, verl and verl.utils
    are stood in by empty packages over the installed folders and verl.utils.device by torch.cuda: only the two
    kernel files run (and `verl` in this process is that stand-in)."""
    spec = importlib.util.find_spec("verl")  # locates the files without running verl/__init__.py
    if spec is None:
        raise ModuleNotFoundError("No module named 'verl'")
    if "verl" not in sys.modules:
        root = Path(spec.submodule_search_locations[0])
        sys.modules["verl"] = _empty_package("verl", root)
        sys.modules["verl.utils"] = _empty_package("verl.utils", root / "utils")
        sys.modules["verl.utils.device"] = _verl_device()
    importlib.import_module("verl.utils.kernel.kernels")  # else first imported by the first call: a failure shows now
    return importlib.import_module("verl.utils.kernel.linear_cross_entropy")


def _verl(op: str) -> Callable:
    linear_cross_entropy = _load_verl().linear_cross_entropy

    def logprobs(input, weight, target, bias=None, *, temperature=1.0, ignore_index=-100):
        _reject_set("verl's linear_cross_entropy", bias=bias is not None)
        if input.shape[-1] % 128:
            raise Unsupported("verl's kernel needs H a multiple of 128")
        # verl has no ignore_index: an ignored row is scored against token 0 and both its outputs are set to 0
        # after the call (torch.where, which also gives the row no gradient), so the function is ours and verl
        # pays for every row, as it would in a trainer. It returns log-probs (not their negative), as ours.
        valid = target != ignore_index
        logps, entropy = linear_cross_entropy(input, weight, torch.where(valid, target, 0), float(temperature),
                                              "none")
        return torch.where(valid, logps.view(target.shape), 0.0), torch.where(valid, entropy.view(target.shape), 0.0)

    return logprobs


@dataclass(frozen=True)
class Peer:
    distribution: str
    load: Callable[[], object]  # imports the peer, raising when it is not installed
    ops: tuple[str, ...]
    adapter: Callable[[str], Callable]  # op -> the peer's implementation with our signature
    interpreted: bool = False  # its kernels also run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1)


def _module(name: str) -> Callable[[], object]:
    return functools.partial(importlib.import_module, name)


PEERS = {
    "liger-kernel": Peer("liger-kernel", _module("liger_kernel"), MODEL_OPS, _liger, interpreted=True),
    "cut-cross-entropy": Peer("cut-cross-entropy", _module("cut_cross_entropy"), ("flce",), _cce),
    "quack": Peer("quack-kernels", _module("quack"), ("flce",), _quack),
    # Not interpreted: verl's host functions open NVTX ranges and assert CUDA tensors before any kernel runs.
    "verl": Peer("verl", _load_verl, ("fused_linear_logprobs",), _verl),
}


def not_installed(name: str) -> Optional[str]:
    """Why peer `name` cannot be imported ("not installed: ..."), or None."""
    try:
        PEERS[name].load()
    except Exception as exc:  # a broken install is as good as none
        return f"not installed: {type(exc).__name__}: {exc}".splitlines()[0]
    return None


def unavailable(name: str, device: torch.device) -> Optional[str]:
    """Why peer `name` cannot run here ("not installed: ...", "needs a CUDA device"), or None."""
    reason = not_installed(name)
    if reason is not None:
        return reason
    interpreted = PEERS[name].interpreted and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return "needs a CUDA device"
    return None
