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
    """Cross-entropy of `input @ weight.T (+ bias)` against `target`, without materializing the logits.

    The options of liger-kernel's LigerFusedLinearCrossEntropyLoss: `ce_weight` [V], class weights as F.cross_entropy's
    `weight=` (a buffer outside the state dict); with `return_z_loss` or `return_token_accuracy` forward returns a
    CrossEntropyOutput (loss, z_loss, token_accuracy), the accuracy being the fraction of rows whose target's logit
    is the row's max (a tie counts as predicted; argmax takes the first)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 softcap: Optional[float] = None, lse_square_scale: float = 0.0,
                 accum_dtype: Optional[torch.dtype] = None, backend: Optional[str] = None, process_group=None, *,
                 ce_weight: Optional[torch.Tensor] = None, return_z_loss: bool = False,
                 return_token_accuracy: bool = False):
        super().__init__("flce", backend, ignore_index=ignore_index, reduction=reduction,
                         label_smoothing=label_smoothing, softcap=softcap, lse_square_scale=lse_square_scale,
                         return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                         accum_dtype=accum_dtype, process_group=process_group)
        self.register_buffer("ce_weight", ce_weight, persistent=False)

    def forward(self, input, weight, target, bias=None):
        return self._call(input, weight, target, bias, self.ce_weight)

    def extra_repr(self) -> str:
        weights = "" if self.ce_weight is None else f"ce_weight=[{self.ce_weight.shape[0]}], "
        return weights + super().extra_repr()


class FusedLinearJSDLoss(_Dispatched):
    """Generalized JSD between student and teacher LM heads (teacher not differentiated)."""

    def __init__(self, jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                 scale_by_temperature_squared: bool = False, accum_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None, process_group=None):
        super().__init__("fused_linear_jsd", backend, jsd_beta=jsd_beta, ignore_index=ignore_index,
                         temperature=temperature, scale_by_temperature_squared=scale_by_temperature_squared,
                         accum_dtype=accum_dtype, process_group=process_group)

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels=None):
        return self._call(student_input, student_weight, teacher_input, teacher_weight, shift_labels)


class FusedLinearKLDivLoss(_Dispatched):
    """KL(target || softmax(student logits / T)) against explicit target probabilities."""

    def __init__(self, reduction: str = "batchmean", ignore_index: int = -100, temperature: float = 1.0,
                 eps: float = 1e-10, log_target: bool = False, accum_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None, process_group=None):
        super().__init__("fused_linear_kl_div", backend, reduction=reduction, ignore_index=ignore_index,
                         temperature=temperature, eps=eps, log_target=log_target, accum_dtype=accum_dtype,
                         process_group=process_group)

    def forward(self, student_input, student_weight, target, shift_labels=None):
        return self._call(student_input, student_weight, target, shift_labels)


class FusedLinearLogProbs(_Dispatched):
    """Per-token log-probs and entropy of the LM head `input @ weight.T (+ bias)` at `temperature` for the tokens in
    `target`, without materializing the logits: `forward(...) -> (logprobs, entropy)`, fp32, the target's shape
    (0 where the target is ignore_index). The RL / preference loss goes on top (liger_dispatch.integrations.rl)."""

    def __init__(self, temperature: float = 1.0, ignore_index: int = -100,
                 accum_dtype: Optional[torch.dtype] = None, backend: Optional[str] = None, process_group=None):
        super().__init__("fused_linear_logprobs", backend, temperature=temperature, ignore_index=ignore_index,
                         accum_dtype=accum_dtype, process_group=process_group)

    def forward(self, input, weight, target, bias=None):
        return self._call(input, weight, target, bias)


class LMHeadLoss(torch.nn.Module):
    """An LM head whose forward is a fused loss instead of logits: `forward(hidden, *loss_args)` is
    `loss(hidden, self.weight, *loss_args)` (with `bias=self.bias` for cross-entropy).

    Owning the head's parameters puts the loss inside the wrapper's hooks: under FSDP2 the weight is gathered before
    the loss reads it and its gradient reduce-scattered after, as for the nn.Linear it replaces (a loss reading
    `lm_head.weight` outside any forward sees the sharded parameter). The state dict matches a Linear's, so
    `LMHeadLoss.from_linear(model.lm_head, loss)` takes its place; a DTensor weight sharded on the vocabulary
    (tensor parallelism) takes the vocab-parallel path."""

    def __init__(self, in_features: int, out_features: int, loss: Optional[torch.nn.Module] = None, *,
                 bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.loss = loss if loss is not None else FusedLinearCrossEntropyLoss()
        if bias and not isinstance(self.loss, FusedLinearCrossEntropyLoss):
            raise ValueError(f"bias: only cross-entropy takes a bias, not {type(self.loss).__name__}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    reset_parameters = torch.nn.Linear.reset_parameters  # nn.Linear's initialization, on the same attributes

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, loss: Optional[torch.nn.Module] = None) -> "LMHeadLoss":
        """A head over `linear`'s own parameters (the same Parameter objects)."""
        head = cls(linear.in_features, linear.out_features, loss, bias=linear.bias is not None, device="meta")
        head.weight, head.bias = linear.weight, linear.bias
        return head

    def forward(self, hidden: torch.Tensor, *loss_args, **loss_kwargs) -> torch.Tensor:
        if self.bias is not None:
            loss_kwargs["bias"] = self.bias
        return self.loss(hidden, self.weight, *loss_args, **loss_kwargs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


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
