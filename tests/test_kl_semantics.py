"""KL targets: one semantics in every backend, torch.nn.functional.kl_div's, and torch's precision.

Row by row, through `dispatch.op`, for the kernel-level kl_div_loss_and_grad and for fused_linear_kl_div:
- bad targets (benchmarks/kl_semantics.md): a negative probability, log-probabilities passed as probabilities,
  zeros, probabilities below eps, +inf, and with log_target a -inf; the loss is NaN where torch's is NaN, the same
  finite value where torch's is finite, and the gradient is finite where torch's is (torch's gradient of a NaN
  row is finite: d/ds of sum_j q_j (log q_j - log_softmax(s)_j) does not involve log q). One departure, chosen:
  a log-target of -inf is q = 0 and contributes 0, where torch computes exp(-inf) * (-inf - x) = 0 * -inf = NaN;
  those rows are compared with torch on the probabilities exp(target) (its xlogy gives 0 log 0 = 0).
- unnormalized log-targets (randn * 3: q up to e^12, rows summing to ~10^3): the loss and the gradient are within
  2x torch fp32's own error against float64, for fp32 and bf16 student logits.
Triton and Helion run in Triton's interpreter here (tests/conftest.py), on tiny shapes.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from liger_dispatch import dispatch

BACKENDS = ["reference", "triton", "helion"]
V = 48
EPS = 1e-10
TWICE = 2.0


# ---------------------------------------------------------------- torch's answer


def torch_rows(student, target, *, log_target, temperature=1.0):
    """(per-row loss, d sum(loss) / d student) from torch's kl_div on log_softmax(student / T).

    Computes in fp32 (float64 when the student is float64); the gradient comes back in the student's dtype."""
    x = student.detach().clone().requires_grad_(True)
    wide = torch.float64 if student.dtype == torch.float64 else torch.float32
    log_s = torch.log_softmax(x.to(wide) / temperature, dim=-1)
    rows = F.kl_div(log_s, target.to(wide), reduction="none", log_target=log_target).sum(-1)
    rows.sum().backward()
    return rows.detach(), x.grad


def expected_rows(student, target, *, log_target, temperature=1.0):
    """torch's rows, but a row holding a log-target of -inf as torch gives it on the probabilities exp(target)."""
    loss, grad = torch_rows(student, target, log_target=log_target, temperature=temperature)
    if log_target:
        minus_inf = (target == -float("inf")).any(-1)
        assert loss[minus_inf].isnan().all()  # torch: 0 * -inf; the departure this suite pins down
        loss_q, grad_q = torch_rows(student, target.float().exp(), log_target=False, temperature=temperature)
        torch.testing.assert_close(grad[minus_inf], grad_q[minus_inf])  # torch's gradient already agrees
        loss = torch.where(minus_inf, loss_q, loss)
    return loss, grad


def assert_rows_agree(actual, expected, what, **tol):
    """NaN where expected is NaN, the same infinity where it is infinite, close where finite; per row."""
    actual, expected = actual.double(), expected.double()
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: NaN rows {actual.isnan()} vs torch's {expected.isnan()}"
    inf = expected.isinf()
    assert torch.equal(actual[inf], expected[inf]), f"{what}: {actual} vs torch's {expected}"
    finite = expected.isfinite()
    torch.testing.assert_close(actual[finite], expected[finite], msg=lambda m: f"{what}: {m}", **tol)


def assert_grads_agree(actual, expected, what, **tol):
    """Finite exactly where torch's gradient is finite, close there (row by row)."""
    for r in range(expected.shape[0]):
        a, e = actual[r].double(), expected[r].double()
        assert torch.equal(a.isfinite(), e.isfinite()), f"{what}, row {r}: finite {a.isfinite()} vs {e.isfinite()}"
        torch.testing.assert_close(a[e.isfinite()], e[e.isfinite()], msg=lambda m: f"{what}, row {r}: {m}", **tol)


# ---------------------------------------------------------------- bad targets


def probabilities(rows=1):
    return torch.softmax(torch.randn(rows, V) * 2, dim=-1)


def probability_cases():
    """name -> [1, V] probability target (log_target=False)."""
    good = probabilities()
    negative, zeros, tiny, plus_inf = good.clone(), good.clone(), good.clone(), good.clone()
    negative[0, 3] = -0.05
    zeros[0, :7] = 0.0
    tiny[0, :7] = 1e-13  # in (0, eps): log max(q, eps) = log eps, a change of at most eps / e in the row's loss
    plus_inf[0, 5] = float("inf")
    return {"probabilities": good, "negative": negative, "log-probabilities": good.log(), "zeros": zeros,
            "below eps": tiny, "+inf": plus_inf}


def log_target_cases():
    """name -> [1, V] log-probability target (log_target=True)."""
    good = probabilities().log()
    minus_inf, plus_inf = good.clone(), good.clone()
    minus_inf[0, :7] = -float("inf")
    plus_inf[0, 5] = float("inf")
    return {"log-probabilities": good, "unnormalized": torch.randn(1, V) * 3, "-inf": minus_inf, "+inf": plus_inf}


CASES = {False: probability_cases, True: log_target_cases}


def kernel_rows(backend, student, target, *, log_target, temperature=1.0):
    """(per-row loss, gradient) of dispatch.op("kl_div_loss_and_grad"): the gradient overwrites a copy of student."""
    grad = student.clone()
    loss = dispatch.op("kl_div_loss_and_grad", backend=backend)(grad, target, None, temperature=temperature,
                                                                 eps=EPS, log_target=log_target)
    return loss, grad


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_bad_targets_as_torch(backend, log_target, target_dtype):
    """All cases in one call, a row each: a bad row spoils only itself."""
    cases = CASES[log_target]()
    target = torch.cat(list(cases.values())).to(target_dtype)
    student = torch.randn(target.shape[0], V) * 2
    loss, grad = kernel_rows(backend, student, target, log_target=log_target, temperature=0.7)
    want_loss, want_grad = expected_rows(student, target, log_target=log_target, temperature=0.7)
    names = ", ".join(cases)
    assert_rows_agree(loss, want_loss, f"{backend} loss of rows {names}", rtol=1e-5, atol=1e-5)
    assert_grads_agree(grad, want_grad, f"{backend} gradient", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_bad_targets_as_torch(backend, log_target):
    """One call a case (the reduced loss and dW mix rows): loss, input.grad and weight.grad as torch's."""
    H = 16
    op = dispatch.op("fused_linear_kl_div", backend=backend)
    weight = torch.randn(V, H) / H**0.5
    for name, row in CASES[log_target]().items():
        target = row.expand(2, V).contiguous()
        x = torch.randn(2, H)
        xs, ws = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = op(xs, ws, target, reduction="sum", eps=EPS, log_target=log_target)
        loss.backward()
        xt, wt = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logits = xt @ wt.T
        want = expected_rows(logits.detach(), target, log_target=log_target)[0].sum()
        torch_rows_loss = F.kl_div(torch.log_softmax(logits, -1), target, reduction="none",
                                   log_target=log_target).sum()
        torch_rows_loss.backward()  # torch's gradients, also for the -inf log-target (they are finite there)
        what = f"{backend} fused_linear_kl_div, {name}"
        assert_rows_agree(loss.detach().reshape(1), want.reshape(1), what, rtol=1e-5, atol=1e-5)
        if name == "unnormalized":  # sums of q up to e^12: two fp32 results differ by more than either's error
            exact = torch_log_target_grads(x.double(), weight.double(), target.double())
            for ours, theirs, wide, which in zip((xs.grad, ws.grad), (xt.grad, wt.grad), exact, ("input", "weight")):
                assert within_twice_torch(error(ours, wide), error(theirs, wide)), f"{what}: {which}.grad"
            continue
        assert_grads_agree(xs.grad, xt.grad, f"{what}: input.grad", rtol=1e-4, atol=1e-5)
        assert_grads_agree(ws.grad, wt.grad, f"{what}: weight.grad", rtol=1e-4, atol=1e-5)


def torch_log_target_grads(x, weight, target):
    """torch's gradients of sum_rows kl_div(log_softmax(x @ weight.T), target, log_target=True) at x and weight."""
    x, weight = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    F.kl_div(torch.log_softmax(x @ weight.T, -1), target, reduction="sum", log_target=True).backward()
    return x.grad, weight.grad


# ---------------------------------------------------------------- precision on unnormalized log-targets


ROUNDING = 2.0**-24  # one rounding of fp32: torch's error on a scalar can land below it by chance
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def error(actual, exact):
    """||actual - exact|| / ||exact||, in float64."""
    return ((actual.double() - exact).norm() / exact.norm()).item()


def row_error(actual, exact):
    """RMS over rows of each row's relative error: a row's loss is a sum dominated by its largest q (e^12 here), so
    a norm over rows would measure the few largest rows' last roundings."""
    return (((actual.double() - exact) / exact.abs()).square().mean().sqrt()).item()


def within_twice_torch(ours, torch_fp32):
    return ours <= TWICE * max(torch_fp32, ROUNDING)


def rounded_like_kernel(exact, dtype, backend):
    """exact rounded to the gradient's dtype as this machine's kernel does it: Triton's interpreter truncates
    fp32 -> bf16 (twice round-to-nearest's error); compiled kernels and torch round to nearest."""
    if dtype == torch.float32 or not (INTERPRETED and backend in ("triton", "helion")):
        return exact.to(dtype)
    return (exact.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_unnormalized_log_target_within_twice_torch_error(backend, dtype):
    check_unnormalized_log_target(backend, dtype, "cpu", rows=32, vocab=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["triton", "cutedsl", "helion"])
def test_gpu_kernel_unnormalized_log_target_within_twice_torch_error(backend, dtype):
    """The same on the GPU's compiled kernels, at a vocabulary that is a multiple of no block size."""
    check_unnormalized_log_target(backend, dtype, "cuda", rows=64, vocab=32003)


def check_unnormalized_log_target(backend, dtype, device, *, rows, vocab):
    C, Vp = rows, vocab
    student = (torch.randn(C, Vp, device=device) * 2).to(dtype)
    target = torch.randn(C, Vp, device=device) * 3  # q = e^target up to ~e^12; each row sums to ~10^4, not 1
    exact_loss, exact_grad = torch_rows(student.double(), target.double(), log_target=True, temperature=0.9)
    torch_loss, torch_grad = torch_rows(student, target, log_target=True, temperature=0.9)
    loss, grad = kernel_rows(backend, student, target, log_target=True, temperature=0.9)
    # the gradient's own rounding to bf16 as the kernel rounds it bounds its error from below
    grad_floor = error(rounded_like_kernel(exact_grad, dtype, backend), exact_grad)
    errors = {"loss": (row_error(loss, exact_loss), row_error(torch_loss, exact_loss)),
              "gradient": (error(grad, exact_grad), max(error(torch_grad, exact_grad), grad_floor))}
    for what, (ours, torch_fp32) in errors.items():
        assert within_twice_torch(ours, torch_fp32), f"{backend} {dtype} {what}: error {ours:.3g} vs torch fp32's {torch_fp32:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_unnormalized_log_target_within_twice_torch_error(backend, dtype):
    N, H, Vp = 6, 32, 160
    x, weight = torch.randn(N, H).to(dtype), (torch.randn(Vp, H) / H**0.5).to(dtype)
    target = torch.randn(N, Vp) * 3

    def run(fn, xx, ww):
        xx, ww = xx.clone().requires_grad_(True), ww.clone().requires_grad_(True)
        loss = fn(xx, ww)
        loss.backward()
        return loss.detach(), xx.grad, ww.grad

    def torch_loss(xx, ww):
        log_s = torch.log_softmax((xx @ ww.T).to(torch.promote_types(xx.dtype, torch.float32)), dim=-1)
        return F.kl_div(log_s, target.to(log_s.dtype), reduction="batchmean", log_target=True)

    exact = run(torch_loss, x.double(), weight.double())
    reference = run(torch_loss, x, weight)
    ours = run(lambda xx, ww: dispatch.op("fused_linear_kl_div", backend=backend)(xx, ww, target, log_target=True),
               x, weight)
    for what, o, t, e in zip(("loss", "input.grad", "weight.grad"), ours, reference, exact):
        assert within_twice_torch(error(o, e), error(t, e)), \
            f"{backend} {dtype} {what}: error {error(o, e):.3g} vs torch's {error(t, e):.3g}"


# ---------------------------------------------------------------- vocab-parallel ops and the host check


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_ops_bad_targets_as_torch(backend):
    """kl_div_vp_stats / kl_div_vp_grad on one slice (the whole vocabulary): loss = q log q - q s + lse Q per row
    (registry/kl_div.py: loss_rows), NaN where torch's is, gradient as torch's."""
    from liger_dispatch.registry.kl_div import loss_rows as kl_div_rows

    cases = probability_cases()
    target = torch.cat(list(cases.values()))
    student = torch.randn(target.shape[0], V) * 2
    stats = dispatch.op("kl_div_vp_stats", backend=backend)(student, target, None, temperature=0.7, eps=EPS)
    grad = student.clone()
    dispatch.op("kl_div_vp_grad", backend=backend)(grad, target, stats[:, 0], stats[:, 1], None, temperature=0.7)
    want_loss, want_grad = expected_rows(student, target, log_target=False, temperature=0.7)
    loss = kl_div_rows(stats)
    plus_inf = list(cases).index("+inf")  # the combined statistics give inf - inf: NaN, not torch's +inf
    assert not loss[plus_inf].isfinite()
    keep = torch.arange(len(cases)) != plus_inf
    assert_rows_agree(loss[keep], want_loss[keep], f"{backend} vocab-parallel loss", rtol=1e-4, atol=1e-4)
    assert_grads_agree(grad, want_grad, f"{backend} vocab-parallel gradient", rtol=1e-5, atol=1e-6)


def test_host_check_names_a_negative_probability():
    from liger_dispatch.errors import InputError
    from liger_dispatch.registry import checks

    good = probabilities(2)
    checks.probabilities("target", good, log_target=False)
    checks.probabilities("target", good.log(), log_target=True)  # log-targets: any real number
    with pytest.raises(InputError, match="target holds -0.25, a negative probability"):
        bad = good.clone()
        bad[1, 3] = -0.25
        checks.probabilities("target", bad, log_target=False)
    with pytest.raises(InputError, match="log_target=True"):
        checks.probabilities("target", good.log(), log_target=False)


@pytest.mark.parametrize("op", ["fused_linear_kl_div", "kl_div_loss_and_grad"])
def test_full_checks_name_a_negative_probability(monkeypatch, op):
    from liger_dispatch.errors import InputError

    monkeypatch.setenv("LIGER_CHECKS", "full")
    target = torch.softmax(torch.randn(2, V), dim=-1)
    target[1, 3] = -0.25
    if op == "fused_linear_kl_div":
        args = (torch.randn(2, 8), torch.randn(V, 8), target)
    else:
        args = (torch.randn(2, V), target)
    with pytest.raises(InputError, match="target holds -0.25, a negative probability"):
        dispatch.op(op, backend="reference")(*args)
    dispatch.op(op, backend="reference")(*args[:-1], target.abs())  # valid probabilities pass
