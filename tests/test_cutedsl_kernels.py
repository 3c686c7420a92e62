"""CuTeDSL loss kernels.

On the CPU: the modules import and register; CPU tensors are declined with "needs a CUDA device"; every
kernel variant compiles for sm_90a (PTX and cubin, so DSL errors and spills surface here); the host
path picks vector widths, scale views and compile keys without recompiling for new shapes.
On the GPU (`pytest -m gpu`): loss and in-place gradient match the reference formulas, including
ragged V, strided rows, every grad_scale form, ignored rows and C * V > 2^31.
"""

import dataclasses
import re
import sys

import pytest
import torch

pytest.importorskip("cutlass")

from liger_dispatch import dispatch  # noqa: E402
from liger_dispatch.backends.cutedsl import _support, ce, jsd, kl_div  # noqa: E402
from liger_dispatch.backends.cutedsl._row import RowLaunch  # noqa: E402
from liger_dispatch.backends.reference import formulas  # noqa: E402
from cutedsl_checks import (check_compiled, cutedsl_impl, kl_target, run_probe, strided_rows,  # noqa: E402
                            validate_only)

OPS = {"ce_loss_and_grad": ce, "jsd_loss_and_grad": jsd, "kl_div_loss_and_grad": kl_div}
bf16, fp16, fp32, i64, i32 = torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32


# ---------------------------------------------------------------------------------------------- CPU


def test_registered_at_priority_10_with_the_backend_capability():
    for op, module in OPS.items():
        impl = cutedsl_impl(op)
        assert impl.priority == 10
        assert impl.fn is getattr(module, op)
        cap = impl.capability
        assert tuple(cap.devices) == ("cuda",) and cap.min_cc == (9, 0) and tuple(cap.modules) == ("cutlass",)
        assert set(cap.dtypes) == {bf16, fp16, fp32}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_cpu_tensors_are_declined_with_needs_a_cuda_device():
    for op in OPS:
        impl = cutedsl_impl(op)
        assert impl.capability.static_reason(torch.device("cpu"), (fp32,)) == "needs a CUDA device, got cpu tensors"
    logits, target = torch.randn(2, 8), torch.tensor([1, 3])
    assert "cutedsl" not in dispatch.available_backends("ce_loss_and_grad", device="cpu", dtype=fp32)
    assert "needs a CUDA device" in str(dispatch.op("ce_loss_and_grad").explain(logits, target))


def test_predicate_declines_rows_too_long_and_odd_label_dtypes():
    impl = cutedsl_impl("ce_loss_and_grad")
    wide = torch.empty(1).expand(2, _support.MAX_COLS + 1)
    assert "exceeds" in impl.capability.predicate(wide, torch.zeros(2, dtype=i64))
    assert "int64 or int32" in impl.capability.predicate(torch.zeros(2, 8), torch.zeros(2, dtype=torch.int16))
    assert impl.capability.predicate(torch.zeros(2, 8), torch.zeros(2, dtype=i32)) is None


VARIANTS = [
    (ce, (bf16, i64, 8, ce.LAUNCH.default, False, False, False)),
    (ce, (fp32, i64, 4, RowLaunch(threads=1024, unroll=2, l2_hints=False), True, True, True)),
    (ce, (fp16, i32, 1, ce.COMPUTE_BOUND_LAUNCH, True, False, True)),
    (ce, (bf16, i64, 4, ce.COMPUTE_BOUND_LAUNCH, True, True, True, True, True)),
    (ce, (fp32, i64, 4, ce.LAUNCH.default, False, False, False, True, True)),
    (jsd, (bf16, bf16, i64, 8, jsd.LAUNCH.default, jsd.FORWARD_KL, True)),
    (jsd, (bf16, bf16, None, 8, RowLaunch(threads=512, unroll=4), jsd.REVERSE_KL, False)),
    (jsd, (fp32, bf16, i64, 4, jsd.MIXTURE_LAUNCH, jsd.MIXTURE, True)),
    (jsd, (fp16, fp16, i32, 2, RowLaunch(threads=64, unroll=1), jsd.MIXTURE, False)),
    (kl_div, (bf16, bf16, i64, 8, kl_div.LAUNCH.default, False, True)),
    (kl_div, (bf16, fp32, None, 4, kl_div.LAUNCH.default, True, False)),
    (ce, (bf16, i64, 8, RowLaunch(threads=256, unroll=4, split=2), True, False, False)),
    (ce, (bf16, i64, 4, RowLaunch(threads=256, unroll=4, split=2), True, True, True, True, True)),
    (jsd, (bf16, bf16, i64, 8, RowLaunch(threads=256, unroll=2, split=4), jsd.MIXTURE, True)),
    (kl_div, (bf16, bf16, i64, 8, RowLaunch(threads=256, unroll=2, split=8), False, True)),
]


@pytest.mark.parametrize("module, key", VARIANTS,
                         ids=[f"{m.__name__.rsplit('.', 1)[1]}{i}" for i, (m, _) in enumerate(VARIANTS)])
def test_kernel_compiles_for_sm90a_without_spills(module, key, tmp_path, monkeypatch):
    monkeypatch.setenv("LIGER_CUTEDSL_DUMP_DIR", str(tmp_path))
    check_compiled(module._compiled.__wrapped__(*key))  # bypass the process cache: always compile here


class _Recorder:
    """Stands in for _compiled on the CPU: records the compile keys and the launch arguments."""

    def __init__(self):
        self.keys, self.calls = [], []

    def __call__(self, *key):
        self.keys.append(key)
        return lambda *args: self.calls.append(args)


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    for module in OPS.values():
        monkeypatch.setattr(module, "_compiled", rec)
    return rec


def test_new_rows_columns_or_row_stride_reuse_the_compile_key(recorder):
    for C, V, pad in [(3, 64, 0), (17, 1024, 0), (5, 128256, 0), (2, 256, 64)]:
        buf = torch.randn(C, V + pad)
        ce.ce_loss_and_grad(buf[:, :V], torch.zeros(C, dtype=i64))
    assert len(set(recorder.keys)) == 1 and recorder.keys[0] == (fp32, i64, 4, ce.LAUNCH.default, False, False, False,
                                                                 False, False)


def test_vector_width_follows_alignment_of_columns_stride_and_base():
    x = torch.randn(4, 1024, dtype=bf16)
    assert _support.pick_vec(1024, x) == 8
    assert _support.pick_vec(1000, x[:, :1000]) == 8
    assert _support.pick_vec(1001, x[:, :1001]) == 1
    assert _support.pick_vec(1020, x[:, 4:]) == 4  # base 8 bytes past a 16-byte boundary
    assert _support.pick_vec(1024, x, x.float()) == 4  # widest dtype caps the shared width at 4 elements
    odd_stride = torch.randn(4, 1026, dtype=bf16)[:, :1024]
    assert _support.pick_vec(1024, odd_stride) == 2


@pytest.mark.parametrize("form", ["0-d", "[C]", "expanded", "strided"])
def test_scale_view_reads_row_i_at_i_times_step(form):
    C = 5
    base = torch.arange(1.0, 2.0 * C + 1)
    scale = {"0-d": torch.tensor(0.25), "[C]": base[:C].clone(), "expanded": torch.tensor(0.5).expand(C),
             "strided": base[::2]}[form]
    view, step = _support.scale_view(scale)
    assert view.dim() == 1 and view.is_contiguous()
    expected = scale.expand(C) if scale.dim() == 0 else scale
    assert torch.equal(torch.stack([view[i * step] for i in range(C)]), expected)


def test_host_path_passes_contiguous_labels_and_the_scale_view(recorder):
    C, V = 6, 96
    s, t = torch.randn(C, V), torch.randn(C, V)
    labels = torch.arange(2 * C)[::2]  # strided
    jsd.jsd_loss_and_grad(s, t, labels, beta=0.5, temperature=2.0, grad_scale=torch.tensor(0.1))
    args = recorder.calls[-1]
    assert args[2].is_contiguous() and torch.equal(args[2], labels)
    assert args[4].shape == (1,) and args[5] == 0 and args[-1] == 0.5
    kl_div.kl_div_loss_and_grad(s, torch.softmax(t, -1), None, eps=0.0)
    assert recorder.calls[-1][-1] > 0  # eps floored: q = 0 then contributes 0, never 0 * log 0


def test_required_arguments_only_take_the_schema_defaults(recorder):
    """No labels, beta 0.5, temperature 1, ignore_index -100, eps 1e-10, probabilities, no scale."""
    s, t = torch.randn(3, 64), torch.randn(3, 64)
    jsd.jsd_loss_and_grad(s, t)
    assert recorder.keys[-1][2:] == (None, 4, jsd.MIXTURE_LAUNCH, jsd.MIXTURE, False)
    assert recorder.calls[-1][2] is None and recorder.calls[-1][4:] == (None, 0, -100, 0.5, 1.0)
    kl_div.kl_div_loss_and_grad(s, torch.softmax(t, -1))
    assert recorder.keys[-1][2:] == (None, 4, kl_div.LAUNCH.default, False, False)
    assert recorder.calls[-1][2] is None and recorder.calls[-1][4:] == (None, 0, -100, 1.0, 1e-10)
    ce.ce_loss_and_grad(s, torch.zeros(3, dtype=i64))
    assert recorder.keys[-1][4:] == (False,) * 5 and recorder.calls[-1][5:] == (None, None, None, -100, 0.0, 0.0, 1.0)


def test_launch_knobs_are_set_outside_the_op_arguments(recorder):
    x, y = torch.randn(3, 64), torch.zeros(3, dtype=i64)
    with ce.LAUNCH.using(threads=512, l2_hints=False):
        ce.ce_loss_and_grad(x, y)
        ce.ce_loss_and_grad(x, y, softcap=30.0)  # set knobs hold for the compute-bound options too
    ce.ce_loss_and_grad(x, y)
    ce.ce_loss_and_grad(x, y, label_smoothing=0.1)
    forced = RowLaunch(threads=512, unroll=2, l2_hints=False, split=8)
    assert [key[3] for key in recorder.keys] == [forced, forced, ce.LAUNCH.default, ce.COMPUTE_BOUND_LAUNCH]


def test_fallback_views_have_the_compiled_dynamic_layouts():
    """Without TVM-FFI, DLPack views must marshal as the fake tensors were compiled: same dynamic modes."""
    import cutlass
    from cutlass._mlir import ir
    from cutlass.cute.runtime import from_dlpack

    def layout(t):
        (mlir_type,) = t.__get_mlir_types__()
        return re.sub(r"\{i64[^}]*\}", "{i64}", str(mlir_type).split('"')[1])

    syms = _support.Syms()
    x = torch.randn(4, 72, dtype=bf16)[:, :64]
    pairs = [(syms.matrix(cutlass.BFloat16, 8), x), (syms.per_row(cutlass.Int64), torch.zeros(4, dtype=i64)),
             (syms.flat(), _support.scale_view(torch.tensor(0.5))[0])]
    with ir.Context(), ir.Location.unknown():
        for fake, real in pairs:
            assert layout(fake) == layout(from_dlpack(real).mark_layout_dynamic(leading_dim=real.dim() - 1))


@pytest.mark.skipif(not _support.USE_TVM_FFI, reason="apache-tvm-ffi is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="presents CPU memory as cuda:0, which must not reach a real GPU")
def test_tvm_ffi_accepts_every_call_the_wrappers_make():
    """A child process runs the wrappers on CPU tensors shown to TVM-FFI as cuda:0 (cutedsl_checks.run_probe)."""
    run_probe(__file__)


def _probe_calls():
    """Child of test_tvm_ffi_accepts_every_call_the_wrappers_make."""
    for module in OPS.values():
        module._compiled = validate_only(module._compiled)
    torch.manual_seed(0)
    C = 6
    y64 = torch.tensor([0, -100, 2, 3, 4, 5])
    wide = lambda V, pad, dtype: torch.randn(C, V + pad).to(dtype)[:, :V]  # noqa: E731
    calls = [
        lambda: ce.ce_loss_and_grad(wide(1000, 0, bf16), y64, grad_scale=torch.tensor(0.5)),
        lambda: ce.ce_loss_and_grad(wide(1001, 3, fp16), y64.int(), grad_scale=torch.rand(2 * C)[::2],
                                    label_smoothing=0.1, softcap=30.0, lse_square_scale=1e-4),
        lambda: ce.ce_loss_and_grad(wide(64, 0, fp32), y64),
        lambda: ce.ce_loss_and_grad(wide(1000, 8, bf16), y64, label_smoothing=0.1, ce_weight=torch.rand(1000),
                                    row_stats=torch.zeros(C, 2)),
        lambda: ce.ce_loss_and_grad(wide(1001, 0, fp16), y64.int(), ce_weight=torch.rand(1001),
                                    row_stats=torch.zeros(2 * C, 2)[C:]),
        lambda: jsd.jsd_loss_and_grad(wide(512, 0, bf16), wide(512, 0, fp32), None, beta=0.5,
                                      grad_scale=torch.tensor(0.5).expand(C)),
        lambda: jsd.jsd_loss_and_grad(wide(300, 8, fp16), wide(300, 0, fp16), y64.int(), beta=0.0, temperature=2.0),
        lambda: jsd.jsd_loss_and_grad(wide(256, 0, bf16), wide(256, 0, bf16), y64, beta=1.0),
        lambda: kl_div.kl_div_loss_and_grad(wide(800, 0, bf16), wide(800, 0, bf16).softmax(-1), y64,
                                            grad_scale=torch.rand(C)),
        lambda: kl_div.kl_div_loss_and_grad(wide(96, 4, fp32), wide(96, 0, fp32).log_softmax(-1), None,
                                            log_target=True),
    ]
    for call in calls:
        call()
    try:  # negative control: the checks are live
        jsd.jsd_loss_and_grad(wide(256, 0, bf16), wide(128, 0, bf16), y64, beta=1.0)
    except ValueError:
        print(f"validated {len(calls)} calls")
        return 0
    print("a teacher of the wrong width was accepted")
    return 1


# ---------------------------------------------------------------------------------------------- GPU

TOL = {bf16: dict(loss=2e-3, grad=2e-2), fp16: dict(loss=1e-3, grad=4e-3), fp32: dict(loss=1e-4, grad=2e-4)}


def _compare(name, dtype, loss, grad, ref_loss, ref_grad):
    tol = TOL[dtype]
    torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=tol["loss"], atol=tol["loss"], msg=name)
    ref = ref_grad.double()
    # relative to the row's largest entry: gradients of tiny probabilities are rounded to the dtype anyway
    err = (grad.double() - ref).abs() / (ref.abs().amax(dim=-1, keepdim=True) + 1e-30)
    assert err.max().item() <= tol["grad"], f"{name}: max row-relative gradient error {err.max().item():.3e}"


def _reference_rows(rows_fn, x, *others, grad_scale=None):
    """Reference loss rows (fp32) and grad_scale * d rows / dx."""
    z = x.detach().float().requires_grad_()
    rows = rows_fn(z, *others)
    scale = torch.ones_like(rows) if grad_scale is None else grad_scale.float().expand_as(rows)
    (grad,) = torch.autograd.grad(rows, z, scale)
    return rows.detach(), grad


GPU_DTYPES = [bf16, fp16, fp32]
GPU_VOCABS = [128256, 262208, 1000, 4099, 32003]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("V", GPU_VOCABS)
def test_gpu_ce_matches_reference(dtype, V):
    torch.manual_seed(0)
    C = 6
    for opts, pad, scale in [({}, 0, None), (dict(label_smoothing=0.1, lse_square_scale=1e-4), 8, torch.tensor(0.25)),
                             (dict(softcap=20.0), 0, torch.rand(C))]:
        x = strided_rows(C, V, dtype, pad)
        target = torch.randint(0, V, (C,), device="cuda")
        target[1] = -100
        scale = None if scale is None else scale.cuda()
        ref_loss, ref_grad = _reference_rows(lambda z, y: formulas.ce_rows(z, y, **opts), x, target, grad_scale=scale)
        loss = ce.ce_loss_and_grad(x, target, grad_scale=scale, **opts)
        _compare(f"ce {opts}", dtype, loss, x, ref_loss, ref_grad)
        assert not x[1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("V", GPU_VOCABS)
def test_gpu_ce_class_weights_and_row_stats_match_reference(dtype, V):
    """Class weights with and without smoothing (the weights then read per column), softcap, and the rows'
    (lse, target is the max) written: a row whose target is its max, one ignored."""
    torch.manual_seed(0)
    C = 6
    weights = torch.rand(V, device="cuda") * 2 + 0.2
    for opts, pad in [(dict(ce_weight=weights), 8), (dict(ce_weight=weights, label_smoothing=0.1, softcap=20.0,
                                                           lse_square_scale=1e-4), 0)]:
        x = strided_rows(C, V, dtype, pad)
        target = torch.randint(0, V, (C,), device="cuda")
        target[1], target[3] = -100, x[3].float().argmax()
        scale = torch.rand(C, device="cuda")
        expected_stats = formulas.ce_row_stats(x.float(), target, softcap=opts.get("softcap"))
        ref_loss, ref_grad = _reference_rows(lambda z, y: formulas.ce_rows(z, y, **opts), x, target, grad_scale=scale)
        row_stats = torch.full((C, 2), 7.0, device="cuda")
        loss = ce.ce_loss_and_grad(x, target, grad_scale=scale, row_stats=row_stats, **opts)
        _compare(f"ce {sorted(opts)}", dtype, loss, x, ref_loss, ref_grad)
        assert torch.equal(row_stats[:, 1], expected_stats[:, 1]) and row_stats[3, 1] == 1
        torch.testing.assert_close(row_stats[:, 0], expected_stats[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("V", GPU_VOCABS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gpu_jsd_matches_reference(dtype, V, beta):
    torch.manual_seed(0)
    C = 5
    s, t = strided_rows(C, V, dtype, pad=16), strided_rows(C, V, dtype)
    labels = torch.tensor([0, -100, 3, 4, 5], device="cuda")
    scale = torch.tensor(0.5, device="cuda").expand(C)
    ref_loss, ref_grad = _reference_rows(
        lambda z, tt, y: formulas.jsd_rows(z, tt, y, beta=beta, temperature=2.0), s, t, labels, grad_scale=scale)
    loss = jsd.jsd_loss_and_grad(s, t, labels, beta=beta, temperature=2.0, grad_scale=scale)
    _compare(f"jsd beta={beta}", dtype, loss, s, ref_loss, ref_grad)
    assert not s[1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("V", GPU_VOCABS)
@pytest.mark.parametrize("log_target", [False, True])
def test_gpu_kl_div_matches_reference(dtype, V, log_target):
    torch.manual_seed(0)
    C = 4
    s = strided_rows(C, V, dtype)
    target = kl_target(C, V, dtype, log_target)
    ref_loss, ref_grad = _reference_rows(
        lambda z, qq: formulas.kl_div_rows(z, qq, None, temperature=1.5, log_target=log_target), s, target)
    loss = kl_div.kl_div_loss_and_grad(s, target, None, temperature=1.5, log_target=log_target)
    _compare(f"kl log_target={log_target}", dtype, loss, s, ref_loss, ref_grad)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 4, 8])
@pytest.mark.parametrize("dtype", [bf16, fp32])
@pytest.mark.parametrize("V", [128256, 4099, 1000])
def test_gpu_rows_split_across_a_cluster_match_reference(split, dtype, V):
    """RowLaunch.split: every check above with each row cut across a cluster of CTAs; at V = 1000 one CTA holds
    the whole row (its one partial tile) and the others hold nothing but still take part in the reductions."""
    with ce.LAUNCH.using(split=split), jsd.LAUNCH.using(split=split), kl_div.LAUNCH.using(split=split):
        test_gpu_ce_matches_reference(dtype, V)
        test_gpu_ce_class_weights_and_row_stats_match_reference(dtype, V)
        for beta in (0.0, 0.5, 1.0):
            test_gpu_jsd_matches_reference(dtype, V, beta)
        for log_target in (False, True):
            test_gpu_kl_div_matches_reference(dtype, V, log_target)


def test_a_kernel_that_takes_a_row_per_cta_refuses_a_split_launch():
    from liger_dispatch.backends.cutedsl import logprobs

    launch = dataclasses.replace(logprobs.LAUNCH.default, split=2)
    with pytest.raises(ValueError, match="a row per CTA"):
        logprobs._stats_compiled.__wrapped__(bf16, i64, 8, launch)


@pytest.mark.gpu
def test_gpu_rows_beyond_2_to_the_31_elements():
    """C * V > 2^31: the last rows are addressed past int32 offsets."""
    torch.manual_seed(0)
    C, V = 8200, 262208
    x = torch.randn(C, V, device="cuda", dtype=bf16)
    target = torch.randint(0, V, (C,), device="cuda")
    rows = torch.tensor([0, 1, C - 2, C - 1], device="cuda")
    picked = x[rows].clone()
    ref_loss, ref_grad = _reference_rows(formulas.ce_rows, picked, target[rows])
    loss = ce.ce_loss_and_grad(x, target)
    _compare("ce C*V > 2^31", bf16, loss[rows], x[rows], ref_loss, ref_grad)


@pytest.mark.gpu
def test_gpu_new_shapes_do_not_recompile():
    x = torch.randn(4, 4096, device="cuda", dtype=bf16)
    ce.ce_loss_and_grad(x, torch.zeros(4, dtype=i64, device="cuda"))
    before = ce._compiled.cache_info().currsize
    for C, V in [(7, 1024), (33, 128256), (2, 8)]:
        ce.ce_loss_and_grad(torch.randn(C, V, device="cuda", dtype=bf16), torch.zeros(C, dtype=i64, device="cuda"))
    assert ce._compiled.cache_info().currsize == before


if __name__ == "__main__":
    sys.exit(_probe_calls())
