"""liger_dispatch::scale_, the backward's in-place scale of the gradients computed in the forward pass: the CUDA
kernel (here in Triton's interpreter) and the CPU path scale exactly by grad_loss, and leave them alone at 1."""

import pytest
import torch

from liger_dispatch import grad_scale

# one rounding of the fp32 product to the gradient's dtype (the interpreter rounds bf16 toward zero: one ulp)
ULP = {torch.float32: 1e-7, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.mark.parametrize("dtype", list(ULP), ids=str)
@pytest.mark.parametrize("n", [1, 100, 2 * grad_scale._BLOCK + 17])
@pytest.mark.parametrize("path", ["kernel", "cpu"])
def test_scales_in_place_by_grad_loss(dtype, n, path):
    scale = grad_scale._scale_cuda if path == "kernel" else grad_scale._scale_cpu
    x = torch.randn(n, dtype=dtype)
    for g in (1.0, 0.25, -3.0):
        y = x.clone()
        scale(y, torch.tensor(g))
        want = x.float() * g
        if g == 1.0:
            assert torch.equal(y, x)
        torch.testing.assert_close(y.float(), want, rtol=ULP[dtype], atol=0.0)
