"""valid_rows (registry/support.py): a mean's count and gradient scale in one launch. The Triton kernel the GPU runs
(in the interpreter here, and compiled for sm_90 by Triton's own ptxas) gives exactly the reference's values, for
any label dtype, ignore_index, strides and length; the losses' means use it."""

import subprocess
import sys
import textwrap

import pytest
import torch

from liger_dispatch.backends.reference import support as reference_support
from liger_dispatch.backends.triton import support as triton_support
from liger_dispatch.compose import fused_linear as fl
from liger_dispatch.core.table import TABLE


def _labels(n, dtype, ignore_index, ignored=0.3):
    labels = torch.randint(0, 50, (n,)).to(dtype)
    labels[torch.rand(n) < ignored] = ignore_index
    return labels


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n", [1, 7, 8192, 8193, 20000])
@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1.0 / 128256])
def test_triton_kernel_gives_the_reference_values(dtype, n, ignore_index, scale):
    labels = _labels(n, dtype, ignore_index)
    got = triton_support.launch_rows(labels, ignore_index, scale)
    expected = reference_support.valid_rows(labels, ignore_index=ignore_index, scale=scale)
    assert got.dtype == expected.dtype == torch.float32 and got.shape == expected.shape == (2,)
    assert torch.equal(got, expected), (got, expected)
    assert got[0] == max(int((labels != ignore_index).sum()), 1)


def test_all_rows_ignored_count_one_not_zero():
    labels = torch.full((9000,), -100)
    for fn in (lambda: triton_support.launch_rows(labels, -100, 2.0),
               lambda: reference_support.valid_rows(labels, ignore_index=-100, scale=2.0)):
        assert fn().tolist() == [1.0, 2.0]


def test_a_strided_target_is_read_as_its_values():
    """A column of a label matrix whose neighbours are ignore_index: the count is the column's."""
    labels = torch.full((700, 3), -100)
    labels[:, 0] = torch.randint(0, 50, (700,))
    got = triton_support.valid_rows(labels[:, 0], ignore_index=-100)
    assert torch.equal(got, torch.tensor([700.0, 1.0]) / torch.tensor([1.0, 700.0]))


def test_the_mean_of_a_call_without_labels_divides_by_its_rows():
    assert fl.mean_scale(None, 6, -100, torch.device("cpu"), 3.0).item() == pytest.approx(0.5)
    assert fl.mean_scale(torch.tensor([1, -100, 2]), 3, -100, torch.device("cpu"), 3.0).item() == 1.5
    count, scale = fl.valid_count(torch.tensor([1, -100, 2]), -100, 3.0)
    assert count.item() == 2.0 and scale.item() == 1.5


def test_the_op_is_machinery_served_by_triton_on_cuda_and_the_reference_elsewhere():
    spec = TABLE.spec("valid_rows")
    assert spec.internal
    backends = {impl.backend: impl.capability.devices for impl in TABLE.candidates("valid_rows")}
    assert backends == {"reference": ("cpu", "cuda"), "triton": ("cuda",)}


def test_kernel_compiles_for_sm90():
    """Compiled by Triton for sm_90 (ptxas included) in a child process: this one runs under the interpreter."""
    script = textwrap.dedent("""
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
        from liger_dispatch.backends.triton.support import ROWS_BLOCK, _rows_kernel
        signature = {"T": "*i64", "OUT": "*fp32", "n": "i32", "ignore_index": "i32", "scale": "fp32",
                     "STEPS": "constexpr", "BLOCK": "constexpr"}
        src = ASTSource(_rows_kernel, signature, constexprs={"STEPS": 3, "BLOCK": ROWS_BLOCK})
        kernel = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert "div.rn.f32" in kernel.asm["ptx"], "IEEE division"
        assert kernel.asm["cubin"][:4] == b"\\x7fELF"
        print("compiled")
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 5000, 131072])
def test_gpu_triton_gives_the_reference_values(n):
    labels = _labels(n, torch.int64, -100).cuda()
    got = triton_support.valid_rows(labels, ignore_index=-100, scale=1.0 / 3)
    assert torch.equal(got, reference_support.valid_rows(labels, ignore_index=-100, scale=1.0 / 3))


@pytest.mark.parametrize("n", [1, 7, 8193])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_with_the_rows_losses_a_third_entry_is_their_mean(n, ignore_index):
    """Given the rows' losses (0 where ignored, as the loss kernels write them), [count, scale / count, scale * their
    sum / count]: a mean loss reduced after its rows in the launch that counts them."""
    labels = _labels(n, torch.int64, ignore_index)
    losses = torch.rand(n) * 10
    losses[labels == ignore_index] = 0
    got = triton_support.launch_rows(labels, ignore_index, 0.5, losses)
    expected = reference_support.valid_rows(labels, ignore_index=ignore_index, scale=0.5, losses=losses)
    assert got.shape == expected.shape == (3,)
    assert torch.equal(got[:2], expected[:2])
    count = max(int((labels != ignore_index).sum()), 1)
    want = losses.double().sum() * 0.5 / count
    torch.testing.assert_close(got[2].double(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(expected[2].double(), want, rtol=1e-6, atol=0)


def test_losses_must_be_fp32_one_per_label():
    labels = torch.randint(0, 5, (6,))
    spec = TABLE.spec("valid_rows")
    for losses, message in ((torch.rand(5), "losses: length is 5"), (torch.rand(6).half(), "must be float32")):
        with pytest.raises(Exception, match=message):
            spec.check(spec.schema.bind((labels,), dict(ignore_index=-100, losses=losses)))


@pytest.mark.parametrize("options", [{}, dict(return_z_loss=True, return_token_accuracy=True, lse_square_scale=1e-3),
                                     dict(label_smoothing=0.1)])
@pytest.mark.parametrize("all_ignored", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_mean_without_gradients_is_the_mean_with_them(options, all_ignored, dtype):
    """flce under no_grad reduces its mean after the rows (no gradient to scale; fp32 rows: float64's keep the
    count first): the same loss and statistics as the call that computes gradients, 0 (not NaN) when every row is
    ignored."""
    from liger_dispatch import dispatch
    torch.manual_seed(0)
    x = torch.randn(12, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(64, 16, dtype=dtype, requires_grad=True)
    y = torch.full((12,), -100) if all_ignored else _labels(12, torch.int64, -100)
    op = dispatch.op("flce", backend="reference")
    with_grads = op(x, w, y, **options)
    with torch.no_grad():
        without = op(x, w, y, **options)
    for got, want in zip(without if isinstance(without, tuple) else (without,),
                         with_grads if isinstance(with_grads, tuple) else (with_grads,)):
        assert torch.isfinite(got).all() and got.dtype == want.dtype
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    assert (without[0] if isinstance(without, tuple) else without).item() != 0 or all_ignored


def _distillation_call(op, labelled, dtype):
    torch.manual_seed(1)
    x = torch.randn(12, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(64, 16, dtype=dtype, requires_grad=True)
    labels = _labels(12, torch.int64, -100) if labelled else None
    if op == "fused_linear_jsd":
        args = (x, w, torch.randn(12, 16, dtype=dtype), torch.randn(64, 16, dtype=dtype), labels)
        return args, [dict(jsd_beta=0.3, temperature=2.0, scale_by_temperature_squared=True), {}]
    args = (x, w, torch.softmax(torch.randn(12, 64, dtype=dtype), -1), labels)
    return args, [dict(reduction=r, temperature=1.5) for r in ("batchmean", "mean", "sum")]


@pytest.mark.parametrize("op", ["fused_linear_jsd", "fused_linear_kl_div"])
@pytest.mark.parametrize("labelled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_distillation_loss_without_gradients_is_the_loss_with_them(op, labelled, dtype):
    """JSD and KL under no_grad take their mean after the rows too (fl.mean_after): the loss of the call that computes
    gradients, for every reduction, with and without labels to ignore."""
    from liger_dispatch import dispatch
    args, options = _distillation_call(op, labelled, dtype)
    handle = dispatch.op(op, backend="reference")
    for kwargs in options:
        want = handle(*args, **kwargs)
        with torch.no_grad():
            got = handle(*args, **kwargs)
        assert torch.isfinite(got) and got.dtype == want.dtype, kwargs
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
