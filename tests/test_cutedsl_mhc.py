"""CuTeDSL mHC coefficient kernels.

On the CPU: the ops register after Triton and before Helion, decline CPU tensors, the per-row Sinkhorn math
matches float64 autograd (on Python floats), every kernel variant compiles for sm_90a, and the launch plans
(K split of the forward, row groups and column widths of the backward) are checked.
On the GPU (`pytest -m gpu`): all five forward outputs and six gradients against float64 autograd of the
formulas, across hc, tmax, dtypes, ragged row counts, strided x, missing upstream gradients, both forward
paths, and the design's shapes; the backward is deterministic.
"""


import pytest
import torch

pytest.importorskip("cutlass")

from liger_dispatch import dispatch  # noqa: E402
from liger_dispatch.backends.cutedsl import _mhc_rows, mhc  # noqa: E402
from liger_dispatch.backends.reference import formulas  # noqa: E402
from liger_dispatch.core.table import TABLE  # noqa: E402
from mhc_checks import MISSING_GRADS, MISSING_GRADS_IDS, check_empty_batch, check_mhc, inputs  # noqa: E402
from cutedsl_checks import cubin_resources, cutedsl_impl  # noqa: E402

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
OPS = ("mhc_coeff_fwd", "mhc_coeff_bwd")


# ---------------------------------------------------------------------------------------------- CPU


def test_registered_between_triton_and_helion():
    for op in OPS:
        impl = cutedsl_impl(op)
        priorities = {i.backend: i.priority for i in TABLE.candidates(op)}
        assert priorities["triton"] < impl.priority < priorities["helion"]
        assert impl.capability.min_cc == (9, 0) and tuple(impl.capability.devices) == ("cuda",)
        assert impl.fn is getattr(mhc, op)


def test_predicate_takes_hc_up_to_8_and_even_k():
    predicate = cutedsl_impl("mhc_coeff_fwd").capability.predicate
    assert predicate(torch.zeros(2, 6), torch.zeros(6, 15), hc=3) is None
    assert "hc=9" in predicate(torch.zeros(2, 18), torch.zeros(18, 99), hc=9)
    assert "odd" in predicate(torch.zeros(2, 9), torch.zeros(9, 15), hc=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_cpu_tensors_are_declined():
    x, phi, b, *alphas = inputs(4, 4, 8)
    assert "needs a CUDA device" in str(dispatch.op("mhc_coeff_fwd").explain(x, phi, b, *alphas, hc=4))


@pytest.mark.parametrize("hc,tmax", [(2, 1), (3, 3), (4, 20)])
def test_sinkhorn_and_its_backward_on_python_floats(hc, tmax, monkeypatch):
    """The unrolled per-row Sinkhorn math the kernels trace, run on Python floats against float64 autograd."""
    monkeypatch.setattr(_mhc_rows.cute.arch, "fmax", max)
    monkeypatch.setattr(_mhc_rows.cute.math, "exp2", lambda v, fastmath=False: 2.0 ** v)
    logits = torch.randn(hc, hc, dtype=torch.float64, requires_grad=True)
    upstream_grad = torch.randn(hc, hc, dtype=torch.float64)
    want = formulas.sinkhorn(logits[None], tmax=tmax, eps=1e-6)[0]
    (want * upstream_grad).sum().backward()
    state = _mhc_rows.sinkhorn(logits.tolist(), tmax, 1e-6)
    torch.testing.assert_close(torch.tensor(state[1], dtype=torch.float64), want.detach(), rtol=1e-12, atol=1e-12)
    grad = _mhc_rows.sinkhorn_backward(*state, upstream_grad.tolist())
    torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64), logits.grad, rtol=1e-9, atol=1e-12)


VARIANTS = [  # (compile function, key, spills allowed)
    (mhc._mix_partials, (bf16, bf16, 24, 32, 8, 2), False),
    (mhc._mix_partials, (fp32, fp32, 24, 4, 4, 1), False),
    (mhc._mix_partials, (bf16, fp32, 15, 8, 4, 2), False),
    (mhc._mix_partials, (fp16, fp16, 80, 8, 8, 2), False),
    (mhc._epilogue, (4, 20), False),
    (mhc._epilogue, (3, 1), False),
    (mhc._coefficient_backward, (2, 20, True, True, True), False),
    # hc = 4 at tmax = 20 keeps 160 Sinkhorn denominators a row: some live in the stack frame
    (mhc._coefficient_backward, (4, 20, True, True, True), True),
    (mhc._coefficient_backward, (3, 1, False, True, False), False),
    (mhc._matmul_backward, (bf16, bf16, 24, 8, 2), False),
    (mhc._matmul_backward, (fp32, fp32, 24, 4, 1), False),
    (mhc._matmul_backward, (fp16, fp32, 15, 8, 2), False),
    (mhc._matmul_backward, (bf16, bf16, 80, 2, 2), False),
    (mhc._reduce, (bf16, 24), False),
]


@pytest.mark.parametrize("compile_fn, key, spills", VARIANTS, ids=[f"{f.__name__}{i}" for i, (f, *_) in
                                                                 enumerate(VARIANTS)])
def test_kernel_compiles_for_sm90a(compile_fn, key, spills, tmp_path, monkeypatch):
    monkeypatch.setenv("LIGER_CUTEDSL_DUMP_DIR", str(tmp_path))
    cubin = compile_fn.__wrapped__(*key).compiled.artifacts.CUBIN  # bypass the process cache
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    res = cubin_resources(cubin)
    assert res["local"] == 0 and (spills or res["frame"] == 0), res


def test_forward_splits_k_until_the_warps_fill_the_gpu():
    assert mhc.forward_splits(8192, 16384, 8, 132, 16) == 4  # 512 warps of 16 rows: 4 splits fill 16 warps an SM
    assert mhc.forward_splits(2048, 4096, 8, 132, 16) == 16  # 128 warps of 16 rows: 16 splits fill 16 warps an SM
    assert mhc.forward_splits(1, 64, 8, 132, 16) == 1  # a k-block per warp at least


def test_matmul_groups_cover_every_row_once_in_steps_of_8():
    for M, K, vec in [(8192, 16384, 8), (2048, 4096, 8), (37, 32, 2), (1, 8, 2)]:
        groups, rows = mhc.matmul_groups(M, K, vec, 132, 16)
        assert rows % 8 == 0 and groups * rows >= M and (groups - 1) * rows < M


def test_matmul_vec_keeps_the_fragments_in_registers():
    x = torch.empty(4, 4096, dtype=bf16)
    assert mhc.matmul_vec(4096, 24, 8, x) == 8  # hc = 4: 3 tiles
    assert mhc.matmul_vec(4096, 80, 8, x) == 2  # hc = 8: 10 tiles


# ---------------------------------------------------------------------------------------------- GPU


def run(*args, **kwargs):
    return check_mhc(mhc, *args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("tmax", [1, 3, 20])
@pytest.mark.parametrize("hc,c", [(2, 64), (3, 40), (4, 256), (8, 16)])
@pytest.mark.parametrize("m", [1, 37, 300])
def test_gpu_matches_float64(m, hc, c, tmax):
    # hc = 8 at tmax = 20: the alpha gradients sum du * mix over rows whose du cancel (softmax gradients), and the
    # reverse Sinkhorn rebuilds each of the 19 rounds' inputs from its output (a few ulps a round): 1e-3, the
    # conformance suite's fp32 tolerance, instead of 1e-4
    run(m, hc, c, tmax, rel_tol=1e-3 if hc == 8 and tmax == 20 else None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,phi_dtype", [(bf16, None), (fp16, None), (bf16, fp32), (fp32, bf16)])
def test_gpu_dtypes_and_strided_x(dtype, phi_dtype):
    run(129, 4, 264, 20, dtype, x_row_stride=4 * 264 + 8, phi_dtype=phi_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("present", MISSING_GRADS, ids=MISSING_GRADS_IDS)
def test_gpu_missing_upstream_gradients(present):
    run(70, 4, 64, 3, present=present)


@pytest.mark.gpu
@pytest.mark.parametrize("b,t,c", [(4, 512, 1024), (4, 2048, 4096)])
def test_gpu_design_shapes(b, t, c):
    """The row blocks fill the GPU at T=2048 (no K split); T=512 splits K."""
    run(b * t, 4, c, 20, bf16)


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    run(1000, 4, 256, 20, deterministic=True)


@pytest.mark.gpu
def test_gpu_empty_batch():
    check_empty_batch(mhc)
