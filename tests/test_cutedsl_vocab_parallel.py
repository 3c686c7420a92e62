"""The CuTeDSL vocab-parallel kernels.

On the CPU: every kernel variant compiles for sm_90a without spills; each wrapper's launches pass TVM-FFI's
argument checks (a child process, as in test_cutedsl_kernels.py); empty slices launch nothing. Their results on a
GPU, slices combined against the whole-vocabulary formulas, are tests/test_vocab_parallel_kernels.py's (`-m gpu`).
"""

import sys

import pytest
import torch

pytest.importorskip("cutlass")

from liger_dispatch.backends.cutedsl import _support, jsd  # noqa: E402
from liger_dispatch.backends.cutedsl import vocab_parallel as vp  # noqa: E402
from liger_dispatch.core.table import TABLE  # noqa: E402
from liger_dispatch.backends.cutedsl._row import RowLaunch  # noqa: E402
from cutedsl_checks import check_compiled, cutedsl_impl, run_probe, validate_only  # noqa: E402
from vp_checks import check_empty_slice  # noqa: E402

bf16, fp16, fp32, i64, i32 = torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32
COMPILE_CACHES = ("_ce_stats", "_ce_grad", "_jsd_stats", "_jsd_sums", "_jsd_grad", "_kl_div_stats", "_kl_div_grad")


# ---------------------------------------------------------------------------------------------- CPU


def test_registered_for_every_op_with_one_capability():
    for op in (n for n in TABLE.op_names("kernel") if "_vp_" in n):
        impl = cutedsl_impl(op)
        assert impl.fn is getattr(vp, op) and impl.priority == vp.VP_PRIORITY and impl.capability == vp.CAPABILITY


def test_capability_judges_the_slice_and_its_index_tensor_wherever_it_is_passed():
    predicate = vp.CAPABILITY.predicate
    x, y16 = torch.zeros(2, 8), torch.zeros(2, dtype=torch.int16)
    assert "int64 or int32" in predicate(x, y16, torch.zeros(2))  # ce_vp_grad: target second
    assert "int64 or int32" in predicate(x, x, torch.zeros(2, 2), torch.zeros(2, 2), labels=y16)  # jsd_vp_grad
    assert predicate(x, x, None) is None and predicate(x, x, torch.zeros(2, dtype=i32)) is None
    assert "exceeds" in predicate(torch.empty(1).expand(2, _support.MAX_COLS + 1), None)


VARIANTS = [
    ("_ce_stats", (bf16, i64, 8, vp.CE_LAUNCH.default, False, False)),
    ("_ce_stats", (fp32, i32, 1, vp.CE_LAUNCH.default, True, False)),
    ("_ce_stats", (bf16, i64, 4, vp.CE_LAUNCH.default, True, True)),
    ("_ce_grad", (bf16, i64, 8, vp.CE_LAUNCH.default, True, True, False, False)),
    ("_ce_grad", (fp16, i64, 2, RowLaunch(threads=1024, unroll=2, l2_hints=False), False, False, False, False)),
    ("_ce_grad", (bf16, i64, 4, vp.CE_LAUNCH.default, True, True, True, True)),
    ("_ce_grad", (fp32, i64, 4, vp.CE_LAUNCH.default, True, False, True, False)),
    ("_jsd_stats", (bf16, bf16, i64, 8, vp.JSD_LAUNCH.default)),
    ("_jsd_sums", (bf16, bf16, i64, 8, vp.JSD_LAUNCH.default, jsd.FORWARD_KL)),
    ("_jsd_sums", (fp32, bf16, None, 4, vp.JSD_LAUNCH.default, jsd.REVERSE_KL)),
    ("_jsd_sums", (bf16, bf16, i32, 8, vp.JSD_LAUNCH.default, jsd.MIXTURE)),
    ("_jsd_grad", (bf16, bf16, i64, 8, vp.JSD_LAUNCH.default, jsd.FORWARD_KL, True)),
    ("_jsd_grad", (bf16, bf16, None, 8, vp.JSD_LAUNCH.default, jsd.REVERSE_KL, False)),
    ("_jsd_grad", (fp16, fp16, i64, 2, RowLaunch(threads=64, unroll=1), jsd.MIXTURE, True)),
    ("_kl_div_stats", (bf16, bf16, i64, 8, vp.KL_DIV_LAUNCH.default, False)),
    ("_kl_div_stats", (bf16, fp32, None, 4, vp.KL_DIV_LAUNCH.default, True)),
    ("_kl_div_grad", (bf16, bf16, i64, 8, vp.KL_DIV_LAUNCH.default, False, True)),
    ("_kl_div_grad", (fp32, fp32, None, 4, vp.KL_DIV_LAUNCH.default, True, False)),
]


@pytest.mark.parametrize("cache, key", VARIANTS, ids=[f"{c[1:]}{i}" for i, (c, _) in enumerate(VARIANTS)])
def test_kernel_compiles_for_sm90a_without_spills(cache, key, tmp_path, monkeypatch):
    monkeypatch.setenv("LIGER_CUTEDSL_DUMP_DIR", str(tmp_path))
    check_compiled(getattr(vp, cache).__wrapped__(*key))  # bypass the process cache: always compile here


def test_empty_slices_launch_nothing(monkeypatch):
    for cache in COMPILE_CACHES:
        monkeypatch.setattr(vp, cache, None)  # a launch would fail
    check_empty_slice(lambda op: getattr(vp, op), "cpu")


@pytest.mark.skipif(not _support.USE_TVM_FFI, reason="apache-tvm-ffi is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="presents CPU memory as cuda:0, which must not reach a real GPU")
def test_tvm_ffi_accepts_every_call_the_wrappers_make():
    run_probe(__file__)


def _probe_calls():
    """Child of test_tvm_ffi_accepts_every_call_the_wrappers_make: each op through every per-row input form it takes
    (a strided [C] lse and target_sum, as sliced from the all-reduced statistics; every grad_scale form)."""
    for cache in COMPILE_CACHES:
        setattr(vp, cache, validate_only(getattr(vp, cache)))
    torch.manual_seed(0)
    C = 6
    y = torch.tensor([0, -100, 2, 300, 4, 5])
    wide = lambda V, pad, dtype: torch.randn(C, V + pad).to(dtype)[:, :V]  # noqa: E731
    stats4, stats5 = torch.randn(C, 4), torch.randn(C, 5)
    pair = torch.randn(C, 2)
    calls = [
        lambda: vp.ce_vp_stats(wide(1000, 0, bf16), y, vocab_start=200),
        lambda: vp.ce_vp_stats(wide(1001, 3, fp32), y.int(), softcap=30.0),
        lambda: vp.ce_vp_stats(wide(1000, 0, bf16), y, vocab_start=200, ce_weight=torch.rand(3000)),
        lambda: vp.ce_vp_grad(wide(1000, 8, bf16), y, stats5, vocab_start=200, vocab_size=3000,
                              grad_scale=torch.tensor(0.5), label_smoothing=0.1, softcap=30.0, lse_square_scale=1e-4),
        lambda: vp.ce_vp_grad(wide(64, 0, fp16), y.int(), stats5, grad_scale=torch.rand(2 * C)[::2]),
        lambda: vp.ce_vp_grad(wide(1000, 0, bf16), y, stats5, vocab_start=204, vocab_size=3000, label_smoothing=0.1,
                              ce_weight=torch.rand(3000)),
        lambda: vp.jsd_vp_stats(wide(512, 0, bf16), wide(512, 0, fp32), y, temperature=2.0),
        lambda: vp.jsd_vp_sums(wide(300, 8, fp16), wide(300, 0, fp16), pair, None, beta=0.0),
        lambda: vp.jsd_vp_sums(wide(256, 0, bf16), wide(256, 0, bf16), pair, y.int(), beta=0.3),
        lambda: vp.jsd_vp_grad(wide(256, 0, bf16), wide(256, 0, bf16), pair, torch.randn(C, 3)[:, 1:], y, beta=1.0,
                               grad_scale=torch.tensor(0.5).expand(C)),
        lambda: vp.kl_div_vp_stats(wide(800, 0, bf16), wide(800, 0, bf16).softmax(-1), y),
        lambda: vp.kl_div_vp_stats(wide(96, 4, fp32), wide(96, 0, fp32).log_softmax(-1), None, log_target=True),
        lambda: vp.kl_div_vp_grad(wide(800, 0, bf16), wide(800, 0, bf16).softmax(-1), stats4[:, 0], stats4[:, 1], y,
                                  grad_scale=torch.rand(C)),
    ]
    for call in calls:
        call()
    try:  # negative control: the checks are live
        vp.jsd_vp_sums(wide(256, 0, bf16), wide(128, 0, bf16), pair, y, beta=1.0)
    except ValueError:
        print(f"validated {len(calls)} calls")
        return 0
    print("a teacher of the wrong width was accepted")
    return 1


if __name__ == "__main__":
    sys.exit(_probe_calls())
