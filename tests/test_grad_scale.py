"""scale_grad, the backward's in-place scale of the gradients computed in the forward pass (registry/support.py):
the Triton kernel (here in Triton's interpreter) and the reference's torch op scale exactly by grad_loss, and leave
them alone at 1."""

import pytest
import torch

from liger_dispatch.backends.reference import support as reference
from liger_dispatch.backends.triton import support as triton_support

# one rounding of the fp32 product to the gradient's dtype (the interpreter rounds bf16 toward zero: one ulp)
ULP = {torch.float32: 1e-7, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


@pytest.mark.parametrize("dtype", list(ULP), ids=str)
@pytest.mark.parametrize("n", [1, 100, 2 * triton_support.SCALE_BLOCK + 17])
@pytest.mark.parametrize("path", ["kernel", "cpu"])
def test_scales_in_place_by_grad_loss(dtype, n, path):
    scale = triton_support.launch_scale if path == "kernel" else reference.scale_grad
    x = torch.randn(n, dtype=dtype)
    for g in (1.0, 0.25, -3.0):
        y = x.clone()
        scale(y, torch.tensor(g))
        want = x.float() * g
        if g == 1.0:
            assert torch.equal(y, x)
        torch.testing.assert_close(y.float(), want, rtol=ULP[dtype], atol=0.0)


@pytest.mark.parametrize("blocks", [4, 5])
def test_fewer_programs_than_blocks_scale_every_block(blocks, monkeypatch):
    """The grid is at most SCALE_PROGRAMS programs striding over the blocks (a partial last block included)."""
    monkeypatch.setattr(triton_support, "SCALE_PROGRAMS", 2)
    n = (blocks - 1) * triton_support.SCALE_BLOCK + 5
    x = torch.randn(n)
    y = x.clone()
    triton_support.launch_scale(y, torch.tensor(-0.5))
    torch.testing.assert_close(y, x * -0.5, rtol=1e-7, atol=0.0)
