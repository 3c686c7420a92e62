"""torch.nn modules over the dispatched ops."""

from __future__ import annotations

from typing import Optional

import torch

from liger_dispatch import dispatch


class _Dispatched(torch.nn.Module):
    """A module over one dispatched op: its options are attributes, passed as keywords on every call."""

    def __init__(self, op: str, backend: Optional[str], **options):
        super().__init__()
        self._options = tuple(options)
        for name, value in options.items():
            setattr(self, name, value)
        self.backend = backend
        self._op = dispatch.op(op, backend=backend)

    def _call(self, *args):
        return self._op(*args, **{n: getattr(self, n) for n in self._options})

    def extra_repr(self) -> str:
        parts = [f"{n}={getattr(self, n)!r}" for n in self._options]
        return ", ".join([*parts, f"backend={self.backend!r}" if self.backend else "backend=auto"])


class FusedLinearCrossEntropyLoss(_Dispatched):
    """Cross-entropy of `input @ weight.T (+ bias)` against `target`, without materializing the logits."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 softcap: Optional[float] = None, lse_square_scale: float = 0.0,
                 accum_dtype: Optional[torch.dtype] = None, backend: Optional[str] = None):
        super().__init__("flce", backend, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing, softcap=softcap, lse_square_scale=lse_square_scale,
                         accum_dtype=accum_dtype)

    def forward(self, input, weight, target, bias=None):
        return self._call(input, weight, target, bias)


class FusedLinearJSDLoss(_Dispatched):
    """Generalized JSD between student and teacher LM heads (teacher not differentiated)."""

    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 scale_by_temperature_squared: bool = False, accum_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None):
        super().__init__("fused_linear_jsd", backend, jsd_beta=jsd_beta, ignore_index=ignore_index,
                         temperature=temperature, scale_by_temperature_squared=scale_by_temperature_squared,
                         accum_dtype=accum_dtype)

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels=None):
        return self._call(student_input, student_weight, teacher_input, teacher_weight, shift_labels)


class FusedLinearKLDivLoss(_Dispatched):
    """KL(target || softmax(student logits / T)) against explicit target probabilities."""

    def __init__(self, reduction: str = "batchmean", ignore_index: int = -100, temperature: float = 1.0,
                 eps: float = 1e-10, log_target: bool = False, accum_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None):
        super().__init__("fused_linear_kl_div", backend, reduction=reduction, ignore_index=ignore_index,
                         temperature=temperature, eps=eps, log_target=log_target, accum_dtype=accum_dtype)

    def forward(self, student_input, student_weight, target, shift_labels=None):
        return self._call(student_input, student_weight, target, shift_labels)


class MHCCoeffs(_Dispatched):
    """mHC coefficients for `streams` residual streams of `channels` each: x [..., HC, C] ->
    (h_pre [..., HC], h_post [..., HC], h_res [..., HC, HC])."""

    def __init__(self, streams: int, channels: int, *, tmax: int = 20, rms_eps: float = 1e-6, pre_eps: float = 0.0,
                 sinkhorn_eps: float = 1e-6, post_mult: float = 2.0, alpha_init: float = 0.01,
                 dtype: Optional[torch.dtype] = None, device=None, backend: Optional[str] = None):
        super().__init__("mhc_coeffs", backend, tmax=tmax, rms_eps=rms_eps, pre_eps=pre_eps,
                         sinkhorn_eps=sinkhorn_eps, post_mult=post_mult)
        self.streams, self.channels = streams, channels
        n = streams * streams + 2 * streams
        self.phi = torch.nn.Parameter(torch.randn(streams * channels, n, device=device, dtype=dtype)
                                      * (streams * channels) ** -0.5)
        self.b = torch.nn.Parameter(torch.zeros(n, device=device, dtype=torch.float32))
        self.alpha_pre = torch.nn.Parameter(torch.tensor(alpha_init, device=device))
        self.alpha_post = torch.nn.Parameter(torch.tensor(alpha_init, device=device))
        self.alpha_res = torch.nn.Parameter(torch.tensor(alpha_init, device=device))

    def forward(self, x):
        return self._call(x, self.phi, self.b, self.alpha_pre, self.alpha_post, self.alpha_res)

    def extra_repr(self) -> str:
        return f"streams={self.streams}, channels={self.channels}, " + super().extra_repr()
