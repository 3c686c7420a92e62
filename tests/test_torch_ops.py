"""The ops as PyTorch ops: schemas checked at registration, torch.library.opcheck, torch.compile(fullgraph=True)
with no graph break equal to eager, the backend preference inside compiled code, autocast, and on a GPU: no host
sync on the hot path and CUDA-graph capture."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import liger_dispatch as ld
from liger_dispatch import dispatch
from liger_dispatch.errors import SignatureError
from liger_dispatch.core.table import TABLE

from kernel_checks import assert_rel_close, keep_some_slices

N, H, V, HC, C = 6, 16, 40, 4, 8
LOSSES = {
    "flce": dict(label_smoothing=0.1, softcap=20.0, lse_square_scale=1e-3),
    "fused_linear_jsd": dict(jsd_beta=0.3, temperature=2.0),
    "fused_linear_kl_div": dict(temperature=1.5),
}


def loss_inputs(op, device="cpu", dtype=torch.float32):
    def t(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    labels = torch.randint(0, V, (N,), device=device)
    labels[1] = -100
    x, w = t(N, H).requires_grad_(), (t(V, H) * 0.3).requires_grad_()
    if op == "flce":
        return x, w, labels, t(V).requires_grad_()
    if op == "fused_linear_jsd":
        return x, w, t(N, H), t(V, H) * 0.3, labels
    return x, w, torch.softmax(t(N, V), -1), labels


def logprobs_inputs(device="cpu", dtype=torch.float32, bias=True):
    x, w, labels, b = loss_inputs("flce", device, dtype)
    return (x, w, labels, b) if bias else (x, w, labels)


def mhc_inputs(device="cpu"):
    n = HC * HC + 2 * HC
    x = torch.randn(2, 3, HC, C, device=device, requires_grad=True)
    phi = (torch.randn(HC * C, n, device=device) * 0.1).requires_grad_()
    b = torch.randn(n, device=device).requires_grad_()
    alphas = [torch.tensor(v, device=device).requires_grad_() for v in (0.5, 0.7, 0.9)]
    return x, phi, b, *alphas


def grads_of(out, tensors):
    outs = out if isinstance(out, tuple) else (out,)
    total = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
    leaves = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, torch.autograd.grad(total, leaves)


def compiled_equals_eager(fn, args, **compile_options):
    """fn compiled with fullgraph=True: no graph break, same outputs and gradients as eager."""
    counters.clear()
    want, want_grads = grads_of(fn(*args), args)
    got, got_grads = grads_of(torch.compile(fn, fullgraph=True, **compile_options)(*args), args)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for g, w in zip((*got, *got_grads), (*want, *want_grads)):
        assert_rel_close("compiled", g, w, 1e-5)


def backends_here(op):
    return [b for b in ("reference", "triton", "helion") if b in ld.available_backends(op, device="cpu",
                                                                                       dtype=torch.float32)]


def handle_here(op, backend):
    """dispatch.op(op, backend=backend), or the test skipped where that backend cannot run op here."""
    if backend not in backends_here(op):
        pytest.skip(f"{backend} cannot run {op} here")
    return dispatch.op(op, backend=backend)


# -- the schema ------------------------------------------------------------------------------------------------------
def test_registration_rejects_a_signature_that_is_not_the_schema(isolated_table):
    def wrong_name(student_logits, teacher, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0,
                   grad_scale=None):
        pass

    def knob(student_logits, teacher_logits, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0,
             grad_scale=None, block_size=None):
        pass

    def wrong_default(student_logits, teacher_logits, labels=None, *, beta=0.2, ignore_index=-100, temperature=1.0,
                      grad_scale=None):
        pass

    for fn, message in ((wrong_name, "parameter 1 is 'teacher', the schema has 'teacher_logits'"),
                        (knob, "'block_size' is not in the op's schema"),
                        (wrong_default, "'beta' must default to 0.5")):
        with pytest.raises(SignatureError, match=f"mine's implementation of jsd_loss_and_grad: .*{message}"):
            ld.register_backend("jsd_loss_and_grad", backend="mine")(fn)


def test_kernel_ops_bind_like_python():
    handle = dispatch.op("jsd_loss_and_grad", backend="reference")
    s, t = torch.randn(2, 5), torch.randn(2, 5)
    assert handle(s, t).shape == (2,)  # labels and beta take their documented defaults
    with pytest.raises(TypeError, match="unexpected keyword argument 'betta'"):
        handle(s, t, betta=0.1)
    with pytest.raises(TypeError, match="missing required argument"):
        handle(s)


# -- torch.library ---------------------------------------------------------------------------------------------------
def _opcheck(op, args, kwargs):
    result = torch.library.opcheck(getattr(torch.ops.liger_dispatch, op).default, args, kwargs)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("op", list(LOSSES))
def test_opcheck_losses(op):
    args = loss_inputs(op)
    need = [True] * len(TABLE.spec(op).differentiable)
    _opcheck(op, args, dict(LOSSES[op], need_grads=need, backend="reference"))
    _opcheck(op, args, dict(LOSSES[op], need_grads=need, logits_grad=True, backend="reference"))
    if op == "flce":
        _opcheck(op, args, dict(reduction="none", backend="reference"))
        _opcheck(op, (*args, None, torch.rand(N)), dict(reduction="sum", need_grads=[True, True, True],
                                                         backend="reference"))  # ce_weight, then row_weights


@pytest.mark.parametrize("bias", [True, False])
def test_opcheck_logprobs(bias, monkeypatch):
    """With a bias and without (the dispatcher drops it), all logits kept, and vocabulary slices of 7 columns (the
    first ones' logits kept, the others recomputed in the backward: more rows than hidden units); the backward op
    too."""
    args = logprobs_inputs(bias=bias)
    _opcheck("fused_linear_logprobs", args, dict(temperature=0.7, backend="reference"))
    narrow = (torch.randn(N, 2, requires_grad=True), torch.randn(V, 2, requires_grad=True), *args[2:])
    keep_some_slices(monkeypatch, N, 2, V, torch.float32, 7)
    _opcheck("fused_linear_logprobs", narrow, dict(backend="reference"))
    args = narrow
    detached = [a.detach() for a in args] + [None] * (4 - len(args))
    _, _, stats, kept = torch.ops.liger_dispatch.fused_linear_logprobs(*detached, temperature=0.7)
    for need in ([True, True, True], [True, False, False]):  # a frozen head: no dW, no db
        _opcheck("fused_linear_logprobs_backward", (*detached, stats, kept, torch.randn(N), None),
                 dict(temperature=0.7, need_grads=need))


def test_opcheck_kernel_level_ops():
    logits, labels = torch.randn(N, V), torch.randint(0, V, (N,))
    _opcheck("ce_loss_and_grad", (logits.clone(), labels), dict(grad_scale=torch.rand(N), label_smoothing=0.1))
    _opcheck("jsd_loss_and_grad", (logits.clone(), torch.randn(N, V), labels), dict(beta=0.3))
    _opcheck("kl_div_loss_and_grad", (logits.clone(), torch.softmax(torch.randn(N, V), -1), None), {})


def test_opcheck_mhc():
    x, phi, b, *alphas = mhc_inputs()
    _opcheck("mhc_coeffs", (x, phi, b, *alphas), dict(tmax=3, backend="reference"))
    rows = x.detach().reshape(-1, HC * C)
    _opcheck("mhc_coeff_fwd", (rows, phi.detach(), b.detach(), *(a.detach() for a in alphas)), dict(hc=HC, tmax=3))
    *_, mix, rstd = torch.ops.liger_dispatch.mhc_coeff_fwd(rows, phi.detach(), b.detach(),
                                                           *(a.detach() for a in alphas), hc=HC, tmax=3)
    grads = (torch.randn(rows.shape[0], HC), None, torch.randn(rows.shape[0], HC, HC))
    _opcheck("mhc_coeff_bwd", (rows, phi.detach(), b.detach(), *(a.detach() for a in alphas), mix, rstd, *grads),
             dict(hc=HC, tmax=3))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backward_op_outputs_are_aligned_and_unaliased(backend):
    """Inductor asserts that an op's outputs start on 16 bytes; a backend's gradients may be views into one buffer its
    kernel fills at once (the mHC alphas'), so the backward op hands out separate, aligned tensors. (Under autograd the
    op's saved outputs are autograd's, and empty: the inputs here need no gradient.)"""
    handle_here("mhc_coeffs", backend)
    x, phi, b, *alphas = (t.detach() for t in mhc_inputs())
    *coeffs, mix, rstd = torch.ops.liger_dispatch.mhc_coeffs(x, phi, b, *alphas, tmax=3, backend=backend)
    upstream = [torch.randn_like(c) for c in coeffs]
    grads = torch.ops.liger_dispatch.mhc_coeffs_backward(x, phi, b, *alphas, mix, rstd, *upstream, tmax=3,
                                                         need_grads=[True] * 6, backend=backend)
    assert [g.data_ptr() % 16 for g in grads] == [0] * len(grads)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == len(grads)


# -- torch.compile ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", list(LOSSES))
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compile_fullgraph_losses(op, backend):
    handle = handle_here(op, backend)
    compiled_equals_eager(lambda *a: handle(*a, **LOSSES[op]), loss_inputs(op))


def _logits_grad_asked(monkeypatch) -> list:
    """What each composed call's run_chunks was asked for logits_grad (OpSpec.logits_grad)."""
    from liger_dispatch.compose import fused_linear as fl
    asked, run_chunks = [], fl.run_chunks
    monkeypatch.setattr(fl, "run_chunks", lambda *a, **k: asked.append(k.get("logits_grad")) or run_chunks(*a, **k))
    return asked


@pytest.mark.parametrize("op", list(LOSSES))
def test_compiled_backward_makes_the_weight_gradient_from_the_logits_gradient(op, monkeypatch):
    """Traced, a call of one chunk keeps the logits' gradient for its backward's weight-gradient GEMM, grad_loss
    applied through the input: the gradients of 0.37 * loss are eager's, and eager calls never ask for it."""
    asked = _logits_grad_asked(monkeypatch)
    handle, args = dispatch.op(op, backend="reference"), loss_inputs(op)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def fn(*a):
        return handle(*a, **LOSSES[op]) * 0.37

    want = torch.autograd.grad(fn(*args), leaves)
    assert asked == [False]
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(fn, fullgraph=True)(*args), leaves)
    assert asked == [False, True]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_rel_close(op, g, w, 1e-5)


def test_a_compiled_loss_of_dynamic_rows_compiles_once(monkeypatch):
    """The one-chunk decision reads N symbolically (no specialization on it) and the settings without changing
    what the trace guards on: one graph for every N under the chunk limit."""
    asked = _logits_grad_asked(monkeypatch)
    handle = dispatch.op("flce", backend="reference")
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda *a: handle(*a) * 0.5, fullgraph=True, dynamic=True)
    w = torch.randn(V, H, requires_grad=True)
    for n in (5, 9, 30):
        x, y = torch.randn(n, H, requires_grad=True), torch.randint(0, V, (n,))
        got = torch.autograd.grad(step(x, w, y), (x, w))
        want = torch.autograd.grad(handle(x, w, y) * 0.5, (x, w))
        for g, ref in zip(got, want):
            assert_rel_close("dynamic", g, ref, 1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert asked == [True, False] * 3  # compiled, then eager


def test_a_variable_set_after_a_compiled_call_does_not_recompile_it(monkeypatch):
    """A setting is read while tracing and kept (Setting.get): the environment changing under an unrelated name, as
    inductor's first compile changes it, leaves the graph as it is."""
    handle = dispatch.op("flce", backend="reference")
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(lambda *a: handle(*a) * 0.5, fullgraph=True)
    args = loss_inputs("flce")[:3]
    step(*args).backward()
    monkeypatch.setenv("LIGER_TEST_UNRELATED_VARIABLE", "1")
    step(*args).backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


@pytest.mark.parametrize("op", list(LOSSES))
@pytest.mark.parametrize("hidden", [96, 72])
def test_compiled_calls_of_several_chunks_keep_the_logits_gradient_no_larger_than_the_weight_gradient(
        op, hidden, monkeypatch):
    """80 rows that the budget cuts into two chunks: traced, their logits' gradient replaces the weight's where it is
    no larger (H = 96 >= 80 rows; H = 72 keeps the chunks), and the gradients of 0.37 * loss are eager's."""
    monkeypatch.setenv("LIGER_CHUNK_BUDGET_MB", "0.001")  # 64 rows a chunk (ROW_ALIGN)
    asked = _logits_grad_asked(monkeypatch)
    handle, rows = dispatch.op(op, backend="reference"), 80
    w, x = (torch.randn(V, hidden) * 0.3).requires_grad_(), torch.randn(rows, hidden, requires_grad=True)
    labels = torch.randint(0, V, (rows,))
    labels[1] = -100
    args = {"flce": (x, w, labels), "fused_linear_jsd": (x, w, torch.randn(rows, hidden), torch.randn(V, hidden), labels),
            "fused_linear_kl_div": (x, w, torch.softmax(torch.randn(rows, V), -1), labels)}[op]

    def fn(*a):
        return handle(*a, **LOSSES[op]) * 0.37

    want = torch.autograd.grad(fn(*args), (x, w))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(fn, fullgraph=True)(*args), (x, w))
    assert asked == [False, hidden >= rows]
    for g, ref in zip(got, want):
        assert_rel_close(op, g, ref, 1e-5)


def test_the_whole_logits_gradient_is_kept_up_to_the_weight_gradients_size():
    """At a 128k x 4k bf16 head: flce and KL keep G up to N = H = 4096 rows, JSD too (its teacher's logits, freed
    after the forward, up to twice dW); one chunk always; a forced chunk size only as one chunk."""
    from liger_dispatch.compose import fused_linear as fl
    head = dict(vocab=128256, bytes_per_logit=2, weight_grad_bytes_per_class=4096 * 2)
    for extra in (0, 2):
        assert fl.keeps_whole_grad(4096, extra_bytes_per_logit=extra, **head)
        assert not fl.keeps_whole_grad(4097, extra_bytes_per_logit=extra, **head)
    assert not fl.keeps_whole_grad(4096, extra_bytes_per_logit=4, **head)  # fp32 teacher logits: 3x dW
    small_head = dict(vocab=256, bytes_per_logit=2, extra_bytes_per_logit=0, weight_grad_bytes_per_class=64 * 2)
    assert fl.keeps_whole_grad(1000, **small_head)  # one chunk of 0.5 MB, however many rows


def test_a_forced_chunk_size_keeps_the_weight_gradient(monkeypatch):
    from liger_dispatch.compose import fused_linear as fl
    monkeypatch.setenv("LIGER_CHUNK_ROWS", "1024")
    head = dict(vocab=128256, bytes_per_logit=2, extra_bytes_per_logit=0, weight_grad_bytes_per_class=4096 * 2)
    assert fl.keeps_whole_grad(1024, **head) and not fl.keeps_whole_grad(2048, **head)


@pytest.mark.parametrize("case", ["chunks", "accum_dtype"])
def test_compiled_calls_of_several_chunks_or_a_wider_accumulator_scale_the_weight_gradient(case, monkeypatch):
    """(A bf16 weight's gradient accumulated in fp32.)"""
    asked = _logits_grad_asked(monkeypatch)
    handle = dispatch.op("flce", backend="reference")
    args = loss_inputs("flce", dtype=torch.bfloat16 if case == "accum_dtype" else torch.float32)
    options = dict(accum_dtype=torch.float32) if case == "accum_dtype" else {}
    if case == "chunks":
        monkeypatch.setenv("LIGER_CHUNK_ROWS", "3")
    torch._dynamo.reset()
    compiled_equals_eager(lambda *a: handle(*a, **options), args)
    assert asked == [False, False]


def test_compile_fullgraph_flce_without_bias():
    """bias left out: the dispatcher drops the trailing default, and the backward still finds its inputs."""
    handle = dispatch.op("flce", backend="reference")
    compiled_equals_eager(lambda *a: handle(*a), loss_inputs("flce")[:3])


def test_compile_fullgraph_flce_per_row():
    handle = dispatch.op("flce", backend="reference")
    compiled_equals_eager(lambda *a: handle(*a, reduction="none"), loss_inputs("flce"))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compile_fullgraph_mhc(backend):
    handle = handle_here("mhc_coeffs", backend)
    compiled_equals_eager(lambda *a: handle(*a, tmax=3), mhc_inputs())


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compile_mhc_of_a_strided_residual_stream(backend):
    """x a transposed view (a residual stream's layout): the backward op's gradients are contiguous, and its fake
    says so (inductor asserts every output's strides against the fake)."""
    handle = handle_here("mhc_coeffs", backend)
    x, *rest = mhc_inputs()
    strided = x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    compiled_equals_eager(lambda *a: handle(*a, tmax=3), (strided, *rest))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_compile_fullgraph_logprobs(backend):
    """Both outputs; the entropy unused; no bias."""
    handle = handle_here("fused_linear_logprobs", backend)
    compiled_equals_eager(lambda *a: handle(*a, temperature=0.7), logprobs_inputs())
    compiled_equals_eager(lambda *a: handle(*a)[0], logprobs_inputs(bias=False))


@pytest.mark.parametrize("op", ["fused_linear_logprobs", "fused_linear_jsd", "fused_linear_kl_div"])
def test_compile_fullgraph_temperature_that_changes(op):
    """A float argument that changes between calls becomes symbolic in torch.compile's next compilation; the checks
    compare it rather than pass it to math (a graph break, an error under fullgraph=True)."""
    torch._dynamo.reset()  # the parametrizations share the lambda's code object: recompiles of one
    handle = dispatch.op(op, backend="reference")
    inputs = logprobs_inputs() if op == "fused_linear_logprobs" else loss_inputs(op)
    compiled = torch.compile(lambda temperature, *a: handle(*a, temperature=temperature), fullgraph=True)
    for temperature in (1.0, 0.9, 0.7):
        counters.clear()
        out = compiled(temperature, *inputs)
        assert not counters["graph_break"], dict(counters["graph_break"])
        want = handle(*inputs, temperature=temperature)
        for g, w in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
            assert_rel_close("compiled", g, w, 1e-5)


def test_compile_fullgraph_nn_modules():
    loss = ld.nn.FusedLinearCrossEntropyLoss(label_smoothing=0.1)
    x, w, y, bias = loss_inputs("flce")
    compiled_equals_eager(lambda x, w: loss(x, w, y, bias), (x, w))
    logprobs = ld.nn.FusedLinearLogProbs(temperature=0.9)
    compiled_equals_eager(lambda x, w: logprobs(x, w, y, bias), (x, w))
    coeffs = ld.nn.MHCCoeffs(HC, C, tmax=3)
    compiled_equals_eager(lambda x: coeffs(x), (mhc_inputs()[0],))


def test_preference_is_read_when_the_compiled_op_runs(isolated_table):
    """Selection runs inside the op: one compiled function follows use_backend and LIGER_BACKEND at run time."""
    from liger_dispatch.backends.reference.ce import ce_loss_and_grad

    calls = []

    @ld.register_backend("ce_loss_and_grad", backend="spy", priority=200, capability=ld.Capability(devices=("cpu",)))
    def spy(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
            lse_square_scale=0.0, ce_weight=None, row_stats=None):
        calls.append(logits.shape)
        return ce_loss_and_grad(logits, target, grad_scale=grad_scale, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, softcap=softcap, lse_square_scale=lse_square_scale,
                                ce_weight=ce_weight, row_stats=row_stats)

    fn = torch.compile(lambda *a: dispatch.op("flce")(*a), fullgraph=True)
    args = loss_inputs("flce")
    fn(*args)
    assert not calls
    with ld.use_backend("spy"):
        fn(*args)
    assert calls
    pinned = torch.compile(lambda *a: dispatch.op("flce", backend="spy")(*a), fullgraph=True)
    calls.clear()
    pinned(*args)
    assert calls


def test_autocast_logprobs():
    x = torch.randn(N, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (N,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = dispatch.op("fused_linear_logprobs")(x, w, y)
        ref = torch.log_softmax(torch.nn.functional.linear(x, w).float(), -1).gather(1, y[:, None])[:, 0]
    (lp.sum() + ent.sum()).backward()
    assert lp.dtype == torch.float32 and w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert_rel_close("autocast logprobs", lp, ref, 1e-2)


def test_backward_scales_by_grad_loss_and_refuses_a_second_backward():
    x, w, y, bias = loss_inputs("flce")
    loss = dispatch.op("flce")(x, w, y, bias)
    grads = torch.autograd.grad(loss * 3.0, (x, w, bias), retain_graph=True)
    want = torch.autograd.grad(3.0 * dispatch.op("flce")(x, w, y, bias), (x, w, bias))
    for g, ref in zip(grads, want):
        assert_rel_close("scaled", g, ref, 1e-6)
    with pytest.raises(RuntimeError, match="cannot be backpropagated twice"):
        torch.autograd.grad(loss, (x, w, bias))


def test_autocast_casts_like_a_linear_layer():
    """An fp32 master weight with a bf16 activation under autocast: cast as F.linear is; gradients in fp32."""
    x = torch.randn(N, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (N,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = dispatch.op("flce")(x, w, y)
        ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float(), y)
    loss.backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    assert_rel_close("autocast flce", loss, ref, 1e-2)


# -- GPU ---------------------------------------------------------------------------------------------------------------
def gpu_backends(op):
    return [b for b in ld.available_backends(op, device="cuda", dtype=torch.bfloat16) if b != "reference"]


def gpu_calls():
    for op in LOSSES:
        for backend in gpu_backends(op):
            handle = dispatch.op(op, backend=backend)
            yield f"{op}-{backend}", (lambda h=handle, o=op: lambda *a: h(*a, **LOSSES[o]))(), \
                lambda o=op: loss_inputs(o, "cuda", torch.bfloat16)
    for backend in gpu_backends("fused_linear_logprobs"):
        handle = dispatch.op("fused_linear_logprobs", backend=backend)
        yield f"fused_linear_logprobs-{backend}", (lambda h=handle: lambda *a: h(*a, temperature=0.7))(), \
            lambda: logprobs_inputs("cuda", torch.bfloat16)
    for backend in gpu_backends("mhc_coeffs"):
        handle = dispatch.op("mhc_coeffs", backend=backend)
        yield f"mhc_coeffs-{backend}", (lambda h=handle: lambda *a: h(*a, tmax=3))(), lambda: mhc_inputs("cuda")


def fresh_leaves(args):
    return tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args)


@pytest.mark.gpu
def test_gpu_hot_path_never_syncs():
    for name, fn, make in gpu_calls():
        args = make()
        grads_of(fn(*args), args)  # compile and warm up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            grads_of(fn(*args), args)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_backward_scales_by_grad_loss():
    """grad_loss != 1 takes the scale kernel's other branch (loss / accumulation steps, say)."""
    for name, fn, make in gpu_calls():
        if name.startswith(("mhc", "fused_linear_logprobs")):  # two outputs: not a loss to scale
            continue
        args = make()
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        want = torch.autograd.grad(fn(*args), leaves)
        got = torch.autograd.grad(fn(*args) * 0.37, leaves)
        for g, w in zip(got, want):
            assert_rel_close(name, g.float(), w.float() * 0.37, 1e-2)


@pytest.mark.gpu
def test_gpu_compile_fullgraph_every_op_and_backend():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, fn, make in gpu_calls():
            torch._dynamo.reset()  # one compiled function per op and backend, not recompiles of one
            counters.clear()
            args = make()
            want, want_grads = grads_of(fn(*args), args)
            got, got_grads = grads_of(torch.compile(fn, fullgraph=True)(*args), args)
            assert not counters["graph_break"], name
            for g, w in zip((*got, *got_grads), (*want, *want_grads)):
                assert_rel_close(name, g, w, 2e-2)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay_every_op_and_backend():
    for name, fn, make in gpu_calls():
        eager_args = make()
        want, want_grads = grads_of(fn(*eager_args), eager_args)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up on a side stream, as torch.cuda.graph asks
            args = fresh_leaves(eager_args)  # leaves whose autograd nodes are made on this stream
            leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            grads_of(fn(*args), args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs, grads = grads_of(fn(*args), args)
        graph.replay()
        torch.cuda.synchronize()
        for g, w in zip((*outs, *grads), (*want, *want_grads)):
            assert_rel_close(name, g, w, 2e-2)
        assert len(grads) == len(leaves)


@pytest.mark.gpu
def test_gpu_reduce_overhead_compile_replays_to_eager():
    for name, fn, make in gpu_calls():
        torch._dynamo.reset()
        args = make()
        want, want_grads = grads_of(fn(*args), args)
        compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            got, got_grads = grads_of(compiled(*args), args)
        for g, w in zip((*got, *got_grads), (*want, *want_grads)):
            assert_rel_close(name, g, w, 2e-2)


def test_every_declared_op_is_a_torch_op():
    for name in TABLE.op_names():
        assert hasattr(torch.ops.liger_dispatch, name), name
