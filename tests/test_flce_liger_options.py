"""liger-kernel 0.8.5's own tests of its fused-linear cross-entropy options (test/transformers/
test_fused_linear_cross_entropy.py: class weights, z-loss, token accuracy, the structured output), ported to flce
on every backend: `pytest -m gpu` runs them at liger-kernel's shapes and dtypes on the GPU's backends; on the CPU
they run at tiny shapes in fp32 on the reference and the interpreted Triton kernels (Helion's interpreted kernels
are held to torch's formulas in tests/test_flce_options.py). Tolerances are liger-kernel's (atol, rtol)."""

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import liger_dispatch as ld
from liger_dispatch import dispatch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def backends(dtype=torch.float32):
    """Every backend serving flce here; on the CPU the interpreted Helion kernels are left out (seconds a case)."""
    found = dispatch.available_backends("flce", DEVICE, dtype)
    return found if GPU else [b for b in found if b != "helion"]


def cases(gpu_params, cpu_params):
    """liger-kernel's parameters marked gpu, and the tiny CPU ones."""
    if GPU:
        return [pytest.param(*p, marks=pytest.mark.gpu) for p in gpu_params]
    return cpu_params


class CrossEntropyWithZLoss(torch.nn.Module):
    """liger-kernel's ground truth: torch's cross-entropy (class weights, label smoothing) plus the z-loss, which a
    mean divides by the rows not ignored."""

    def __init__(self, weight=None, lse_square_scale=0.0, reduction="mean", ignore_index=-100,
                 label_smoothing=0.0, return_z_loss=False, dtype=torch.float32):
        super().__init__()
        self.weight, self.lse_square_scale, self.reduction = weight, lse_square_scale, reduction
        self.ignore_index, self.label_smoothing, self.return_z_loss, self.dtype = (ignore_index, label_smoothing,
                                                                                   return_z_loss, dtype)

    def forward(self, logits, targets):
        logits = logits.to(torch.float32)
        target_mask = targets != self.ignore_index
        ce_loss = F.cross_entropy(logits, targets, weight=self.weight, reduction=self.reduction,
                                  label_smoothing=self.label_smoothing, ignore_index=self.ignore_index)
        lse = torch.logsumexp(logits, dim=-1)
        z_loss = torch.where(target_mask, self.lse_square_scale * (lse ** 2), 0.0)
        if self.reduction == "mean":
            z_loss = z_loss.sum() / target_mask.sum()
        elif self.reduction == "sum":
            z_loss = z_loss.sum()
        total = ce_loss.to(self.dtype) + z_loss.to(self.dtype)
        return (total, z_loss.to(self.dtype)) if self.return_z_loss else total


class TorchLMHeadCE(torch.nn.Module):
    def __init__(self, H, V, dtype, bias=False, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                 label_smoothing=0.0, reduction="mean", softcap: Optional[float] = None, return_z_loss=False):
        super().__init__()
        self.lin = torch.nn.Linear(in_features=H, out_features=V, bias=bias, dtype=dtype)
        self.ce_loss = CrossEntropyWithZLoss(weight=ce_weight, ignore_index=ignore_index,
                                             lse_square_scale=lse_square_scale, label_smoothing=label_smoothing,
                                             reduction=reduction, return_z_loss=return_z_loss)
        self.softcap = softcap

    def forward(self, x, y):
        logits = self.lin(x).to(torch.float32)
        if self.softcap is not None and self.softcap != 0.0:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return self.ce_loss(logits, y)


class OursLMHeadCE(torch.nn.Module):
    """liger-kernel's LigerLMHeadCE over liger_dispatch.nn.FusedLinearCrossEntropyLoss (input before weight)."""

    def __init__(self, H, V, dtype, backend, ce_weight=None, bias=False, ignore_index=-100, lse_square_scale=0.0,
                 label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None):
        super().__init__()
        self.lin = torch.nn.Linear(in_features=H, out_features=V, bias=bias, dtype=dtype)
        self.ce_loss = ld.nn.FusedLinearCrossEntropyLoss(
            ce_weight=ce_weight, ignore_index=ignore_index, lse_square_scale=lse_square_scale,
            label_smoothing=label_smoothing, reduction=reduction, softcap=softcap, return_z_loss=return_z_loss,
            accum_dtype=accum_dtype, backend=backend)

    def forward(self, x, y):
        return self.ce_loss(x, self.lin.weight, y, self.lin.bias)


def assert_close(got, want, atol, rtol):
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def assert_same_loss_and_grads(out1, out2, x1, x2, torch_ce, ours, atol, rtol):
    """ours' loss (out2 of x2) against torch's (out1 of x1), and after a backward of ones the gradients of the
    inputs and of each head's parameters."""
    assert_close(out2, out1, atol, rtol)
    out1.backward(gradient=torch.ones_like(out1))
    out2.backward(gradient=torch.ones_like(out2))
    assert_close(x2.grad, x1.grad, atol, rtol)
    assert_close(ours.lin.weight.grad, torch_ce.lin.weight.grad, atol, rtol)
    if ours.lin.bias is not None:
        assert_close(ours.lin.bias.grad, torch_ce.lin.bias.grad, atol, rtol)


def ignored_targets(BT, V, ignore_index):
    """liger-kernel's targets: random classes, a random count of them (at least one) set to ignore_index."""
    target = torch.randint(0, V, (BT,), device=DEVICE, dtype=torch.long)
    count = torch.randint(1, max(BT // 2, 2), (1,)).item()
    target[torch.randperm(BT)[:count]] = ignore_index
    return target


LIGER_SHAPES = [(8, 128, 1024, 4096), (4, 47, 31, 123)]
TINY_SHAPE = [(2, 4, 16, 37)]
OPTIONS = [(False, 0, -100, 0, None, False, None), (True, 0.1, 42, 1e-4, 30.0, True, torch.float32)]
OPTION_NAMES = "has_ce_weight, label_smoothing, ignore_index, lse_square_scale, softcap, return_z_loss, accum_dtype"


def correctness_cases():
    gpu = [(backend, *shape, *precision, bias, *options)
           for backend in (backends(torch.bfloat16) if GPU else []) for shape in LIGER_SHAPES
           for precision in (("mean", 1.0, torch.bfloat16, 5e-3, 5e-2), ("mean", 1.0, torch.float32, 1e-5, 5e-4),
                             ("sum", 1.0, torch.bfloat16, 5e-0, 5e1), ("sum", 1.0, torch.float32, 1e-3, 5e-2))
           for bias in (True, False) for options in OPTIONS]
    cpu = [(backend, *TINY_SHAPE[0], reduction, 1.0, torch.float32, 1e-5, 5e-4, bias, *options)
           for backend in backends() for reduction in ("mean", "sum") for bias in (True, False) for options in OPTIONS]
    return cases(gpu, cpu)


@pytest.mark.parametrize(f"backend, B, T, H, V, reduction, scalar, dtype, atol, rtol, bias, {OPTION_NAMES}",
                         correctness_cases())
def test_correctness(backend, B, T, H, V, reduction, scalar, dtype, atol, rtol, bias, has_ce_weight,
                     label_smoothing, ignore_index, lse_square_scale, softcap, return_z_loss, accum_dtype):
    torch.manual_seed(42)
    ce_weight = torch.rand(V, device=DEVICE, dtype=torch.float32) if has_ce_weight else None
    options = dict(bias=bias, ce_weight=ce_weight, lse_square_scale=lse_square_scale, label_smoothing=label_smoothing,
                   ignore_index=ignore_index, reduction=reduction, softcap=softcap, return_z_loss=return_z_loss)
    torch_ce = TorchLMHeadCE(H=H, V=V, dtype=dtype, **options).to(DEVICE)
    ours = OursLMHeadCE(H=H, V=V, dtype=dtype, backend=backend, accum_dtype=accum_dtype, **options).to(DEVICE)
    torch_ce.lin.weight.data = ours.lin.weight.data = torch.rand(V, H, device=DEVICE, dtype=dtype)
    if bias:
        torch_ce.lin.bias.data = ours.lin.bias.data = torch.rand(V, device=DEVICE, dtype=dtype)
    tensor = torch.randn(B * T, H, device=DEVICE, dtype=dtype) * scalar
    x1, x2 = tensor.detach().clone().requires_grad_(True), tensor.detach().clone().requires_grad_(True)
    target = ignored_targets(B * T, V, ignore_index)

    if return_z_loss:
        out1, z1 = torch_ce(x1, target)
        result = ours(x2, target)
        assert isinstance(result, ld.CrossEntropyOutput)
        out2, z2 = result.loss, result.z_loss
        assert_close(z2, z1, atol, rtol)
    else:
        out1, out2 = torch_ce(x1, target), ours(x2, target)
    assert_same_loss_and_grads(out1, out2, x1, x2, torch_ce, ours, atol, rtol)


def functional_cases():
    gpu = [(backend, *shape, *precision, bias, ce_weight) for backend in (backends(torch.bfloat16) if GPU else [])
           for shape in ((2, 2, 8, 8), (9, 7, 41, 41))
           for precision in ((1.0, torch.bfloat16, 5e-3, 5e-2), (1.0, torch.float32, 1e-5, 5e-4))
           for bias in (True, False) for ce_weight in (True, False)]
    cpu = [(backend, 9, 7, 41, 41, 1.0, torch.float32, 1e-5, 5e-4, True, True) for backend in backends()]
    return cases(gpu, cpu)


@pytest.mark.parametrize("backend, B, T, H, V, scalar, dtype, atol, rtol, bias, ce_weight", functional_cases())
def test_correctness_functional(backend, B, T, H, V, scalar, dtype, atol, rtol, bias, ce_weight):
    """liger-kernel's functional call with every option on, here against torch's formulas on the same logits (the
    head in the input's dtype, then fp32, as TorchLMHeadCE; its class weights are standard normal: negative ones
    too)."""
    torch.manual_seed(42)
    x = torch.randn(B * T, H, device=DEVICE, dtype=dtype) * scalar
    x1, x2 = x.detach().clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    target = torch.randint(0, V, (B * T,), device=DEVICE, dtype=torch.long)
    weight = torch.randn(V, H, device=DEVICE, dtype=dtype)
    bias = torch.randn(V, device=DEVICE, dtype=dtype) if bias else None
    ce_weight = torch.randn(V, device=DEVICE) if ce_weight else None
    result = dispatch.op("flce", backend=backend)(x1, weight, target, bias, ce_weight, ignore_index=-100,
                                                  lse_square_scale=1e-4, label_smoothing=0.1, reduction="mean",
                                                  softcap=30.0, return_z_loss=True, accum_dtype=torch.float32)
    logits = 30.0 * torch.tanh(F.linear(x2, weight, bias).float() / 30.0)
    y2, z2 = CrossEntropyWithZLoss(weight=ce_weight, lse_square_scale=1e-4, label_smoothing=0.1,
                                   return_z_loss=True)(logits, target)
    assert_close(result.loss, y2, atol, rtol)
    assert_close(result.z_loss, z2, atol, rtol)
    grad_output = torch.randn_like(y2)
    result.loss.backward(grad_output)
    y2.backward(grad_output)
    assert_close(x1.grad, x2.grad, atol, rtol)


def accuracy_cases():
    gpu = [(backend, *shape, *precision, bias, flag) for backend in (backends(torch.bfloat16) if GPU else [])
           for shape in LIGER_SHAPES
           for precision in (("mean", 1.0, torch.bfloat16, 5e-3, 5e-2), ("mean", 1.0, torch.float32, 1e-5, 5e-4))
           for bias in (True, False) for flag in (True, False)]
    cpu = [(backend, *TINY_SHAPE[0], "mean", 1.0, torch.float32, 1e-5, 5e-4, True, True) for backend in backends()]
    return cases(gpu, cpu)


@pytest.mark.parametrize("backend, B, T, H, V, reduction, scalar, dtype, atol, rtol, bias, return_token_accuracy",
                         accuracy_cases())
def test_correctness_with_token_accuracy(backend, B, T, H, V, reduction, scalar, dtype, atol, rtol, bias,
                                         return_token_accuracy):
    torch.manual_seed(42)
    torch_ce = TorchLMHeadCE(H=H, V=V, bias=bias, reduction=reduction, dtype=dtype).to(DEVICE)
    ours = OursLMHeadCE(H=H, V=V, bias=bias, reduction=reduction, dtype=dtype, backend=backend).to(DEVICE)
    torch_ce.lin.weight.data = ours.lin.weight.data = torch.rand(V, H, device=DEVICE, dtype=dtype)
    if bias:
        torch_ce.lin.bias.data = ours.lin.bias.data = torch.rand(V, device=DEVICE, dtype=dtype)
    tensor = torch.randn(B * T, H, device=DEVICE, dtype=dtype) * scalar
    x1, x2 = tensor.detach().clone().requires_grad_(True), tensor.detach().clone().requires_grad_(True)
    target = ignored_targets(B * T, V, -100)
    out1 = torch_ce(x1, target)
    result = dispatch.op("flce", backend=backend)(x2, ours.lin.weight, target, ours.lin.bias if bias else None,
                                                  ignore_index=-100, reduction=reduction,
                                                  return_token_accuracy=return_token_accuracy)
    if return_token_accuracy:
        assert isinstance(result, ld.CrossEntropyOutput)
        out2 = result.loss
        with torch.no_grad():
            logits = x2 @ ours.lin.weight.t()
            if bias:
                logits = logits + ours.lin.bias
            mask = target != -100
            expected = ((logits.argmax(dim=-1) == target) & mask).sum().float() / mask.sum().float()
        assert_close(result.token_accuracy, expected, atol, rtol)
    else:
        out2 = result
        assert not isinstance(result, ld.CrossEntropyOutput)
    assert_same_loss_and_grads(out1, out2, x1, x2, torch_ce, ours, atol, rtol)


STRUCTURED = [(z, acc) for z in (False, True) for acc in (False, True)]


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.gpu) for b in backends()] if GPU
                         else ["reference"])
@pytest.mark.parametrize("return_z_loss, return_token_accuracy", STRUCTURED)
def test_structured_output(backend, return_z_loss, return_token_accuracy):
    hidden_states = torch.tensor([[0.2, -0.1], [1.0, 0.5], [-0.3, 0.7]], device=DEVICE, requires_grad=True)
    weight = torch.tensor([[0.5, -0.4], [-0.2, 0.3], [0.1, 0.6]], device=DEVICE)
    bias = torch.tensor([0.1, -0.2, 0.05], device=DEVICE)
    targets = torch.tensor([0, 1, 2], device=DEVICE)
    flags = dict(return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
    result = dispatch.op("flce", backend=backend)(hidden_states, weight, targets, bias, **flags)
    logits = hidden_states @ weight.t() + bias
    expected_loss = F.cross_entropy(logits, targets)
    module_result = ld.nn.FusedLinearCrossEntropyLoss(backend=backend, **flags)(hidden_states, weight, targets, bias)
    for out in (result, module_result):
        if not return_z_loss and not return_token_accuracy:
            assert isinstance(out, torch.Tensor)
            torch.testing.assert_close(out, expected_loss, atol=1e-6, rtol=0)
            continue
        assert isinstance(out, ld.CrossEntropyOutput)
        torch.testing.assert_close(out.loss, expected_loss, atol=1e-6, rtol=0)
        assert (out.z_loss is not None) == return_z_loss
        assert (out.token_accuracy is not None) == return_token_accuracy
        if return_token_accuracy:
            expected_accuracy = (logits.argmax(dim=-1) == targets).float().mean()
            torch.testing.assert_close(out.token_accuracy, expected_accuracy, atol=1e-6, rtol=0)
    (result if isinstance(result, torch.Tensor) else result.loss).backward()
    assert hidden_states.grad is not None
