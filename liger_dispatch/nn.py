"""torch.nn modules over the dispatched ops."""

from __future__ import annotations

from typing import Optional

import torch

from liger_dispatch import dispatch


def _options_repr(module, names) -> str:
    parts = [f"{n}={getattr(module, n)!r}" for n in names]
    backend = getattr(module, "backend", None)
    parts.append(f"backend={backend!r}" if backend else "backend=auto")
    return ", ".join(parts)


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Cross-entropy of `input @ weight.T (+ bias)` against `target`, without materializing the logits."""

    _options = ("ignore_index", "reduction", "label_smoothing", "softcap", "lse_square_scale", "accum_dtype")

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 softcap: Optional[float] = None, lse_square_scale: float = 0.0,
                 accum_dtype: Optional[torch.dtype] = None, backend: Optional[str] = None):
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.softcap, self.lse_square_scale, self.accum_dtype = softcap, lse_square_scale, accum_dtype
        self.backend = backend
        self._op = dispatch.op("flce", backend=backend)

    def forward(self, input, weight, target, bias=None):
        return self._op(input, weight, target, bias, **{n: getattr(self, n) for n in self._options})

    def extra_repr(self) -> str:
        return _options_repr(self, self._options)


class FusedLinearJSDLoss(torch.nn.Module):
    """Generalized JSD between student and teacher LM heads (teacher not differentiated)."""

    _options = ("jsd_beta", "ignore_index", "temperature", "scale_by_temperature_squared", "accum_dtype")

    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 scale_by_temperature_squared: bool = False, accum_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None):
        super().__init__()
        self.jsd_beta, self.ignore_index, self.temperature = jsd_beta, ignore_index, temperature
        self.scale_by_temperature_squared, self.accum_dtype = scale_by_temperature_squared, accum_dtype
        self.backend = backend
        self._op = dispatch.op("fused_linear_jsd", backend=backend)

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels=None):
        return self._op(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                        **{n: getattr(self, n) for n in self._options})

    def extra_repr(self) -> str:
        return _options_repr(self, self._options)


class FusedLinearKLDivLoss(torch.nn.Module):
    """KL(target || softmax(student logits / T)) against explicit target probabilities."""

    _options = ("reduction", "ignore_index", "temperature", "eps", "log_target", "accum_dtype")

    def __init__(self, reduction: str = "batchmean", ignore_index: int = -100, temperature: float = 1.0,
                 eps: float = 1e-10, log_target: bool = False, accum_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None):
        super().__init__()
        self.reduction, self.ignore_index, self.temperature = reduction, ignore_index, temperature
        self.eps, self.log_target, self.accum_dtype = eps, log_target, accum_dtype
        self.backend = backend
        self._op = dispatch.op("fused_linear_kl_div", backend=backend)

    def forward(self, student_input, student_weight, target, shift_labels=None):
        return self._op(student_input, student_weight, target, shift_labels,
                        **{n: getattr(self, n) for n in self._options})

    def extra_repr(self) -> str:
        return _options_repr(self, self._options)


class MHCCoeffs(torch.nn.Module):
    """mHC coefficients for `streams` residual streams of `channels` each: x [..., HC, C] ->
    (h_pre [..., HC], h_post [..., HC], h_res [..., HC, HC])."""

    _options = ("tmax", "rms_eps", "pre_eps", "sinkhorn_eps", "post_mult")

    def __init__(self, streams: int, channels: int, *, tmax: int = 20, rms_eps: float = 1e-6, pre_eps: float = 0.0,
                 sinkhorn_eps: float = 1e-6, post_mult: float = 2.0, alpha_init: float = 0.01,
                 dtype: Optional[torch.dtype] = None, device=None, backend: Optional[str] = None):
        super().__init__()
        self.streams, self.channels = streams, channels
        self.tmax, self.rms_eps, self.pre_eps = tmax, rms_eps, pre_eps
        self.sinkhorn_eps, self.post_mult = sinkhorn_eps, post_mult
        self.backend = backend
        n = streams * streams + 2 * streams
        self.phi = torch.nn.Parameter(torch.randn(streams * channels, n, device=device, dtype=dtype)
                                      * (streams * channels) ** -0.5)
        self.b = torch.nn.Parameter(torch.zeros(n, device=device, dtype=torch.float32))
        self.alpha_pre = torch.nn.Parameter(torch.tensor(alpha_init, device=device))
        self.alpha_post = torch.nn.Parameter(torch.tensor(alpha_init, device=device))
        self.alpha_res = torch.nn.Parameter(torch.tensor(alpha_init, device=device))
        self._op = dispatch.op("mhc_coeffs", backend=backend)

    def forward(self, x):
        return self._op(x, self.phi, self.b, self.alpha_pre, self.alpha_post, self.alpha_res,
                        **{n: getattr(self, n) for n in self._options})

    def extra_repr(self) -> str:
        return f"streams={self.streams}, channels={self.channels}, " + _options_repr(self, self._options)
