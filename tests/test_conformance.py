"""The conformance suite, driven by the registry: every (op, backend) that can run here is compared with
the reference formulas on fresh random inputs. A new backend is tested by registering it.

On the CPU the shapes are tiny (Triton and Helion kernels run in Triton's interpreter); `pytest -m gpu`
runs the same cases at real shapes on the GPU."""

from __future__ import annotations

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import dispatch
from kernel_checks import FLCE_CASES, assert_rel_close
from liger_dispatch.backends.reference import formulas

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
LOW_PRECISION = (torch.bfloat16, torch.float16)
# The interpreter is slow: on the CPU every option runs in fp32 and the low-precision dtypes get the
# smoke cases; on the GPU every case runs in every dtype.
DTYPES = (torch.float32, *LOW_PRECISION) if ON_GPU else (torch.float32,)
# compared with a float64 oracle on the same inputs; tf32 matrix units land near 3e-4
# in bf16 and fp16 the logits themselves are rounded to the input dtype (as in any torch model); JSD and KL
# gradients amplify that rounding
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}
USER_OPS = ("flce", "fused_linear_jsd", "fused_linear_kl_div", "fused_linear_logprobs", "mhc_coeffs")


def cases(ops=USER_OPS, dtypes=DTYPES):
    params = []
    for op in ops:
        for dtype in dtypes:
            status = dispatch.backend_status(op, DEVICE, dtype)
            for backend in ld.registered_backends(op):
                why = status.get(backend)
                marks = () if why is None else (pytest.mark.skip(reason=why),)
                params.append(pytest.param(op, backend, dtype, marks=marks,
                                           id=f"{op}-{backend}-{str(dtype).replace('torch.', '')}"))
    return params


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("LIGER_STRICT", "1")  # a pinned backend that silently fell back would test nothing


def assert_close(name, got, want, dtype):
    assert got is not None and want is not None, f"{name}: missing"
    assert_rel_close(name, got, want, TOLERANCE[dtype])


def leaf(t: torch.Tensor, grad=True) -> torch.Tensor:
    return t.detach().clone().requires_grad_(grad)


def run_and_compare(op, backend, dtype, inputs, kwargs, grad_names, upstream=0.7, used=None, row_upstream=1.0):
    """Calls the backend and the reference formula on copies of `inputs`, backpropagates the same
    upstream gradient through both, and compares outputs and the gradients of `grad_names`. used: the outputs
    backpropagated through (default all; the others' gradients are absent); row_upstream: the scale of the random
    upstream gradient of a per-row output."""
    mine = {k: leaf(v, k in grad_names) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    oracle = torch.float64  # the truth from the same (already rounded) inputs
    theirs = {k: leaf(v.to(oracle) if v.is_floating_point() else v, k in grad_names)
              if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    got = dispatch.op(op, backend=backend)(*mine.values(), **kwargs)
    want = getattr(formulas, op)(*theirs.values(), **kwargs)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    total_got, total_want = 0, 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(f"{op} output {i}", g.float(), w.float(), dtype)
        if used is not None and i not in used:
            continue
        weights = (torch.randn(w.shape, device=w.device, dtype=torch.float32) * row_upstream if w.dim()
                   else torch.tensor(upstream))
        total_got = total_got + (g.float() * weights.to(g.device)).sum()
        total_want = total_want + (w.float() * weights.to(w.device)).sum()
    total_got.backward()
    total_want.backward()
    for name in grad_names:
        assert_close(f"{op} grad of {name}", mine[name].grad, theirs[name].grad, dtype)


def randn(*shape, dtype=torch.float32, scale=1.0):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).mul_(scale).to(dtype)


def labels(n, vocab, ignored=(), all_ignored=False):
    y = torch.randint(0, vocab, (n,), device=DEVICE)
    if all_ignored:
        y.fill_(-100)
    for i in ignored:
        y[i] = -100
    return y


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a transposed storage: stride(-1) != 1."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


N, H, V = (512, 256, 4099) if ON_GPU else (7, 16, 131)
pytestmark = [pytest.mark.gpu] if ON_GPU else []  # on a GPU host: `pytest -m gpu` runs this suite at real shapes


@pytest.mark.parametrize("case", list(FLCE_CASES))
@pytest.mark.parametrize("op,backend,dtype", cases(("flce",)))
def test_flce(op, backend, dtype, case):
    x, w = randn(N, H, dtype=dtype), randn(V, H, dtype=dtype, scale=H ** -0.5)
    inputs = dict(input=x, weight=w, target=labels(N, V, ignored=(1,)))
    run_and_compare(op, backend, dtype, inputs, FLCE_CASES[case], ("input", "weight"))


@pytest.mark.parametrize("op,backend,dtype", cases(("flce",)))
def test_flce_bias_3d_noncontiguous(op, backend, dtype):
    x = non_contiguous(randn(2, 4, H, dtype=dtype))
    inputs = dict(input=x, weight=randn(V, H, dtype=dtype, scale=H ** -0.5), target=labels(8, V, ignored=(0, 5)).view(2, 4),
                  bias=randn(V, dtype=dtype))
    run_and_compare(op, backend, dtype, inputs, dict(label_smoothing=0.05), ("input", "weight", "bias"))


@pytest.mark.parametrize("rows", [1, 0])
@pytest.mark.parametrize("op,backend,dtype", cases(("flce",)))
def test_flce_single_row_and_all_ignored(op, backend, dtype, rows):
    n = max(rows, 3)
    inputs = dict(input=randn(n, H, dtype=dtype), weight=randn(V, H, dtype=dtype, scale=H ** -0.5),
                  target=labels(n, V, all_ignored=rows == 0))
    run_and_compare(op, backend, dtype, inputs, {}, ("input", "weight"))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature,t_squared", [(1.0, False), (2.0, True), (0.7, False)])
@pytest.mark.parametrize("op,backend,dtype", cases(("fused_linear_jsd",)))
def test_fused_linear_jsd(op, backend, dtype, beta, temperature, t_squared):
    h_t = H + 8  # the teacher's hidden size may differ from the student's
    inputs = dict(student_input=randn(N, H, dtype=dtype), student_weight=randn(V, H, dtype=dtype, scale=H ** -0.5),
                  teacher_input=randn(N, h_t, dtype=dtype), teacher_weight=randn(V, h_t, dtype=dtype, scale=h_t ** -0.5),
                  shift_labels=labels(N, V, ignored=(2,)))
    run_and_compare(op, backend, dtype, inputs,
                    dict(jsd_beta=beta, temperature=temperature, scale_by_temperature_squared=t_squared),
                    ("student_input", "student_weight"))


@pytest.mark.parametrize("op,backend,dtype", cases(("fused_linear_jsd",)))
def test_fused_linear_jsd_no_labels_all_ignored_noncontiguous(op, backend, dtype):
    base = dict(student_input=non_contiguous(randn(N, H, dtype=dtype)),
                student_weight=randn(V, H, dtype=dtype, scale=H ** -0.5),
                teacher_input=randn(N, H, dtype=dtype), teacher_weight=randn(V, H, dtype=dtype, scale=H ** -0.5))
    run_and_compare(op, backend, dtype, base, dict(jsd_beta=0.3), ("student_input", "student_weight"))
    run_and_compare(op, backend, dtype, {**base, "shift_labels": labels(N, V, all_ignored=True)}, {},
                    ("student_input", "student_weight"))


def kl_target(n, vocab, dtype, log_target, zeros):
    probs = torch.softmax(randn(n, vocab, scale=2.0), dim=-1)
    if zeros:
        probs[:, ::5] = 0
        probs = probs / probs.sum(-1, keepdim=True)
    return (probs.clamp_min(1e-30).log() if log_target else probs).to(dtype)


@pytest.mark.parametrize("reduction", ["batchmean", "mean", "sum"])
@pytest.mark.parametrize("log_target,zeros,temperature", [(False, True, 1.0), (True, False, 2.0), (False, False, 0.5)])
@pytest.mark.parametrize("op,backend,dtype", cases(("fused_linear_kl_div",)))
def test_fused_linear_kl_div(op, backend, dtype, reduction, log_target, zeros, temperature):
    inputs = dict(student_input=randn(N, H, dtype=dtype), student_weight=randn(V, H, dtype=dtype, scale=H ** -0.5),
                  target=kl_target(N, V, torch.float32, log_target, zeros), shift_labels=labels(N, V, ignored=(3,)))
    run_and_compare(op, backend, dtype, inputs,
                    dict(reduction=reduction, log_target=log_target, temperature=temperature),
                    ("student_input", "student_weight"))


LOGPROBS_CASES = {  # (kwargs, ignored rows, with bias, outputs backpropagated through)
    "T0.7-both": (dict(temperature=0.7), (1, 4), False, None),
    "T1-bias": ({}, (0,), True, None),
    "T2-no-entropy-grad": (dict(temperature=2.0), (2,), True, (0,)),
    "entropy-grad-only": (dict(temperature=1.3), (), False, (1,)),
    "all-ignored": ({}, tuple(range(N)), True, None),
}


def logprobs_inputs(n, dtype, ignored=(), bias=False, shape=None):
    x = randn(n, H, dtype=dtype)
    target = labels(n, V, ignored=ignored)
    if shape is not None:  # [..., H] input, non-contiguous
        x, target = non_contiguous(x.view(*shape, H)), target.view(shape)
    inputs = dict(input=x, weight=randn(V, H, dtype=dtype, scale=2 * H ** -0.5), target=target)
    if bias:
        inputs["bias"] = randn(V, dtype=dtype)
    return inputs


@pytest.mark.parametrize("case", list(LOGPROBS_CASES))
@pytest.mark.parametrize("op,backend,dtype", cases(("fused_linear_logprobs",)))
def test_fused_linear_logprobs(op, backend, dtype, case):
    """Random upstream gradients on logprobs and entropy (or on one of them only: the other's is None)."""
    kwargs, ignored, bias, used = LOGPROBS_CASES[case]
    inputs = logprobs_inputs(N, dtype, ignored, bias)
    run_and_compare(op, backend, dtype, inputs, kwargs, ("input", "weight", "bias") if bias else ("input", "weight"),
                    used=used)


@pytest.mark.parametrize("rows", ["3", "64"])
@pytest.mark.parametrize("op,backend,dtype", cases(("fused_linear_logprobs",)))
def test_fused_linear_logprobs_3d_noncontiguous_chunked(op, backend, dtype, rows, monkeypatch):
    """[2, 4, H] non-contiguous input with a bias; 3 rows a chunk: the first chunk's logits are kept from the
    forward, the other two recomputed in the backward (64: all kept)."""
    monkeypatch.setenv("LIGER_CHUNK_ROWS", rows)
    inputs = logprobs_inputs(8, dtype, ignored=(0, 5), bias=True, shape=(2, 4))
    run_and_compare(op, backend, dtype, inputs, dict(temperature=0.8), ("input", "weight", "bias"))


@pytest.mark.parametrize("case", ["tiny-upstream", "cold-large-upstream"])
@pytest.mark.parametrize("op,backend,dtype", cases(("fused_linear_logprobs",), (torch.float16,)))
def test_fused_linear_logprobs_fp16_gradient_range(op, backend, dtype, case):
    """fp16 gradient buffers: upstream gradients ~1e-5 (a GRPO mean over many tokens) over a wide vocabulary put
    every per-logit gradient below fp16's smallest normal; a cold temperature, large logits and upstream ~300 push
    them past fp16's range. The backward scales g and h by the row bound (registry/logprobs.py:grad_bound) and dX,
    dW, db back: the float64 numbers either way."""
    if case == "tiny-upstream":
        n, vocab, scale, kwargs, upstream = 64, 1031, 1.0, {}, 1e-5
    else:
        n, vocab, scale, kwargs, upstream = N, V, 6.0, dict(temperature=0.25), 300.0
    inputs = dict(input=randn(n, H, dtype=dtype), weight=randn(vocab, H, dtype=dtype, scale=scale * H ** -0.5),
                  target=labels(n, vocab, ignored=(1,)), bias=randn(vocab, dtype=dtype))
    run_and_compare(op, backend, dtype, inputs, kwargs, ("input", "weight", "bias"), row_upstream=upstream)


MHC_SHAPES = ((4, 512, 4, 1024), (2048, 4, 256)) if ON_GPU else ((2, 3, 4, 8), (5, 2, 8))
MHC_CASES = [(shape, tmax) for shape in MHC_SHAPES for tmax in (1, 3, 20)] if ON_GPU else [
    (MHC_SHAPES[0], 3), (MHC_SHAPES[1], 1), (MHC_SHAPES[1], 20)]


@pytest.mark.parametrize("shape,tmax", MHC_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
@pytest.mark.parametrize("op,backend,dtype", cases(("mhc_coeffs",)))
def test_mhc_coeffs(op, backend, dtype, shape, tmax):
    hc, c = shape[-2], shape[-1]
    n = hc * hc + 2 * hc
    x = randn(*shape, dtype=dtype)
    if len(shape) == 4:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
    inputs = dict(x=x, phi=randn(hc * c, n, dtype=dtype, scale=(hc * c) ** -0.5), b=randn(n, scale=0.5),
                  alpha_pre=torch.tensor(0.8, device=DEVICE), alpha_post=torch.tensor(1.1, device=DEVICE),
                  alpha_res=torch.tensor(0.9, device=DEVICE))
    run_and_compare(op, backend, dtype, inputs, dict(tmax=tmax, pre_eps=0.01),
                    ("x", "phi", "b", "alpha_pre", "alpha_post", "alpha_res"))


@pytest.mark.parametrize("rows", ["1", "3", "64"])
@pytest.mark.parametrize("op", ["flce", "fused_linear_jsd", "fused_linear_kl_div"])
def test_chunked_driver_chunk_sizes_reference(op, rows, monkeypatch):
    """The shared driver on the reference kernels: chunk sizes that do not divide N give the same answer."""
    monkeypatch.setenv("LIGER_CHUNK_ROWS", rows)
    dtype = torch.float32
    n = 11
    x, w = randn(n, H), randn(V, H, scale=H ** -0.5)
    if op == "flce":
        inputs = dict(input=x, weight=w, target=labels(n, V, ignored=(4,)), bias=randn(V))
        grads = ("input", "weight", "bias")
        kwargs = dict(label_smoothing=0.1)
    elif op == "fused_linear_jsd":
        inputs = dict(student_input=x, student_weight=w, teacher_input=randn(n, H), teacher_weight=randn(V, H),
                      shift_labels=labels(n, V, ignored=(4,)))
        grads, kwargs = ("student_input", "student_weight"), dict(jsd_beta=0.5, temperature=2.0)
    else:
        inputs = dict(student_input=x, student_weight=w, target=kl_target(n, V, dtype, False, True))
        grads, kwargs = ("student_input", "student_weight"), {}
    run_and_compare(op, "reference", dtype, inputs, kwargs, grads)


def test_budget_chunking_runs_small_batches_as_one_chunk():
    from liger_dispatch.compose.fused_linear import chunk_rows

    assert chunk_rows(2048, 128256, 2) == 2048  # 512 MB budget: one chunk
    rows = chunk_rows(16384, 128256, 2)
    assert rows % 64 == 0 and rows * 128256 * 2 <= 512 * 2**20 + 64 * 128256 * 2
    assert chunk_rows(1000, 128256, 2) == 1000
    assert -(-5000 // chunk_rows(5000, 128256, 2)) == 3  # balanced: three chunks of ~1700, not 2048+2048+904


@pytest.mark.parametrize("op,backend,dtype", cases(dtypes=LOW_PRECISION))
def test_low_precision_smoke(op, backend, dtype):
    """bf16 / fp16 on the CPU: one representative case per op (every case runs in them on the GPU)."""
    if op == "flce":
        inputs = dict(input=randn(N, H, dtype=dtype), weight=randn(V, H, dtype=dtype, scale=H ** -0.5),
                      target=labels(N, V, ignored=(1,)))
        run_and_compare(op, backend, dtype, inputs, dict(label_smoothing=0.1), ("input", "weight"))
    elif op == "fused_linear_jsd":
        inputs = dict(student_input=randn(N, H, dtype=dtype), student_weight=randn(V, H, dtype=dtype, scale=H ** -0.5),
                      teacher_input=randn(N, H, dtype=dtype), teacher_weight=randn(V, H, dtype=dtype, scale=H ** -0.5),
                      shift_labels=labels(N, V, ignored=(2,)))
        run_and_compare(op, backend, dtype, inputs, dict(jsd_beta=0.5, temperature=2.0),
                        ("student_input", "student_weight"))
    elif op == "fused_linear_kl_div":
        inputs = dict(student_input=randn(N, H, dtype=dtype), student_weight=randn(V, H, dtype=dtype, scale=H ** -0.5),
                      target=kl_target(N, V, dtype, False, True))
        run_and_compare(op, backend, dtype, inputs, {}, ("student_input", "student_weight"))
    elif op == "fused_linear_logprobs":
        run_and_compare(op, backend, dtype, logprobs_inputs(N, dtype, (1,), True), dict(temperature=0.7),
                        ("input", "weight", "bias"))
    else:
        test_mhc_coeffs(op, backend, dtype, MHC_SHAPES[0], 3)


@pytest.mark.parametrize("op", ["fused_linear_kl_div", "fused_linear_jsd", "flce"])
def test_fp16_gradients_keep_their_digits(op):
    """fp16 chunk buffers: a mean over many rows and a wide vocabulary makes every per-logit gradient smaller
    than fp16's smallest normal; the driver scales them into range and back (reference kernels, float64 truth)."""
    n, h, vocab, dtype = 96, 32, 2053, torch.float16
    x, w = randn(n, h, dtype=dtype), randn(vocab, h, dtype=dtype, scale=h ** -0.5)
    if op == "flce":
        inputs, kwargs = dict(input=x, weight=w, target=labels(n, vocab)), {}
    elif op == "fused_linear_jsd":
        inputs = dict(student_input=x, student_weight=w, teacher_input=randn(n, h, dtype=dtype),
                      teacher_weight=randn(vocab, h, dtype=dtype, scale=h ** -0.5))
        kwargs = dict(jsd_beta=0.5)
    else:
        inputs = dict(student_input=x, student_weight=w, target=kl_target(n, vocab, torch.float32, False, False))
        kwargs = dict(reduction="batchmean")
    grads = ("input", "weight") if op == "flce" else ("student_input", "student_weight")
    run_and_compare(op, "reference", dtype, inputs, kwargs, grads)


EMPTY_CASES = {
    "flce": [dict(reduction="mean"), dict(reduction="sum", lse_square_scale=0.1), dict(reduction="none")],
    "fused_linear_jsd": [dict(jsd_beta=0.5), dict(jsd_beta=0.0, with_labels=True)],
    "fused_linear_kl_div": [dict(reduction="batchmean"), dict(reduction="mean", with_labels=True),
                            dict(reduction="sum", log_target=True)],
    "fused_linear_logprobs": [{}],
    "mhc_coeffs": [{}],
}


def empty_batch(op, dtype, with_labels=False, **kwargs):
    """(inputs with zero rows, the differentiable ones requiring grad; the op's keywords)."""
    x, w = randn(0, H, dtype=dtype), randn(V, H, dtype=dtype)
    rows = labels(0, V) if with_labels else None
    if op in ("flce", "fused_linear_logprobs"):
        inputs = dict(input=x, weight=w, target=labels(0, V), bias=randn(V, dtype=dtype))
    elif op == "fused_linear_jsd":
        inputs = dict(student_input=x, student_weight=w, teacher_input=randn(0, H, dtype=dtype),
                      teacher_weight=randn(V, H, dtype=dtype), shift_labels=rows)
    elif op == "fused_linear_kl_div":
        inputs = dict(student_input=x, student_weight=w, target=randn(0, V).softmax(-1).to(dtype), shift_labels=rows)
    else:
        hc, c = MHC_SHAPES[1][-2:]
        n = hc * hc + 2 * hc
        inputs = dict(x=randn(0, hc, c, dtype=dtype), phi=randn(hc * c, n, dtype=dtype), b=randn(n),
                      alpha_pre=torch.tensor(0.8, device=DEVICE), alpha_post=torch.tensor(1.1, device=DEVICE),
                      alpha_res=torch.tensor(0.9, device=DEVICE))
    teacher = ("teacher_input", "teacher_weight", "target")  # never differentiated
    return {k: leaf(v, v.is_floating_point() and k not in teacher) for k, v in inputs.items() if v is not None}, kwargs


@pytest.mark.parametrize("op,backend,dtype", cases() + cases(dtypes=(torch.float16,)))
def test_empty_batch(op, backend, dtype):
    """Zero rows: loss 0 (as when every row is ignored), an empty per-row result, zero or empty gradients."""
    for options in EMPTY_CASES[op]:
        inputs, kwargs = empty_batch(op, dtype, **options)
        out = dispatch.op(op, backend=backend)(*inputs.values(), **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        for o in outs:
            if kwargs.get("reduction") == "none" or op in ("mhc_coeffs", "fused_linear_logprobs"):
                assert o.shape[0] == 0, f"{op} {options}: output shape {tuple(o.shape)}"
            else:
                assert o.shape == () and o.item() == 0.0, f"{op} {options}: loss {o}"
        sum(o.float().sum() for o in outs).backward()
        for name, t in inputs.items():
            if t.requires_grad:
                assert t.grad is not None and t.grad.shape == t.shape, f"{op} {options}: no gradient for {name}"
                assert (t.grad == 0).all(), f"{op} {options}: gradient of {name} is not zero"


FP16_ADVERSARIAL = {
    # a strong z-loss on logits ~ 20: d loss / d logit reaches 1 + 2 * 0.5 * lse ~ 20
    "flce-zloss-softcap": ("flce", dict(softcap=20.0, lse_square_scale=0.5, reduction="sum"), 8.0),
    "flce-zloss-none": ("flce", dict(lse_square_scale=0.5, reduction="none"), 8.0),
    "jsd-cold": ("fused_linear_jsd", dict(jsd_beta=0.0, temperature=0.05), 1.0),
    "jsd-reverse-cold": ("fused_linear_jsd", dict(jsd_beta=1.0, temperature=0.25), 1.0),
    # probabilities passed as log-probabilities (as liger-kernel's own tests do): exp(target) sums to ~V per row
    "kl-unnormalized": ("fused_linear_kl_div", dict(log_target=True, reduction="sum"), 1.0),
}


def fp16_adversarial_cases():
    return [pytest.param(*p.values, case, marks=p.marks, id=f"{p.id}-{case}")
            for case, (op, _, _) in FP16_ADVERSARIAL.items() for p in cases((op,), (torch.float16,))]


@pytest.mark.parametrize("op,backend,dtype", cases(dtypes=(torch.float16,)))
def test_fp16_gradients_of_the_loss_beyond_fp16_are_scaled_first(op, backend, dtype):
    """Eight rows of activations ~8000 (CE and KL: all pushing one vocabulary row; JSD: reverse KL from a teacher
    with log-probabilities down to ~-500): d loss / dW passes fp16's 65504 while the gradient after the upstream
    0.25 does not. It must come back finite and right, as plain autograd gives it (the upstream scales before the
    GEMM): the forward may not round the gradient of the loss itself to fp16."""
    if op in ("mhc_coeffs", "fused_linear_logprobs"):
        pytest.skip(f"{op} computes its gradients in the backward, already scaled")
    rows, hidden, vocab = 8, 16, 131
    x = torch.rand(rows, hidden, device=DEVICE).add_(0.5).mul_(8000.0).to(dtype)
    w = randn(vocab, hidden, dtype=dtype, scale=1e-4)
    if op == "flce":
        target = torch.full((rows,), 3, device=DEVICE)
        inputs, grads = dict(input=x, weight=w, target=target), ("input", "weight")
    elif op == "fused_linear_jsd":
        inputs = dict(student_input=x, student_weight=w, teacher_input=randn(rows, hidden, dtype=dtype),
                      teacher_weight=randn(vocab, hidden, dtype=dtype, scale=32.0))
        grads = ("student_input", "student_weight")
    else:
        target = torch.zeros(rows, vocab, device=DEVICE).index_fill_(1, torch.tensor([3], device=DEVICE), 1.0)
        inputs = dict(student_input=x, student_weight=w, target=target.to(dtype))
        grads = ("student_input", "student_weight")
    options = dict(jsd_beta=1.0) if op == "fused_linear_jsd" else dict(reduction="sum")  # JSD: a mean
    run_and_compare(op, backend, dtype, inputs, options, grads, upstream=0.25)


@pytest.mark.parametrize("op,backend,dtype,case", fp16_adversarial_cases())
def test_fp16_gradients_never_overflow(op, backend, dtype, case):
    """fp16 buffers hold the gradient scaled up (see grad_bounds.py): inputs whose per-logit gradients are far
    above 1 must not overflow them (or dX) into inf / NaN."""
    _, kwargs, logit_scale = FP16_ADVERSARIAL[case]
    x, w = randn(N, H, dtype=dtype), randn(V, H, dtype=dtype, scale=logit_scale * H ** -0.5)
    if op == "flce":
        inputs, grads = dict(input=x, weight=w, target=labels(N, V, ignored=(1,))), ("input", "weight")
    elif op == "fused_linear_jsd":
        inputs = dict(student_input=x, student_weight=w, teacher_input=randn(N, H, dtype=dtype, scale=4.0),
                      teacher_weight=randn(V, H, dtype=dtype, scale=H ** -0.5))
        grads = ("student_input", "student_weight")
    else:
        x = randn(N, H, dtype=dtype, scale=4.0)  # a confident student: softmax near one-hot
        inputs = dict(student_input=x, student_weight=w, target=torch.softmax(randn(N, V), -1).to(dtype))
        grads = ("student_input", "student_weight")
    run_and_compare(op, backend, dtype, inputs, kwargs, grads)
