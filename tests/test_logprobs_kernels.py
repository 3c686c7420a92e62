"""The per-token log-prob / entropy kernel-level ops (registry/logprobs.py) of every registered backend that can run
here, through dispatch: logprobs_stats and logprobs_grad against float64 autograd of formulas.logprobs_rows (the
spec), on one whole vocabulary and on slices of it combined as the driver combines them.

On the CPU Triton and Helion run in Triton's interpreter with 16-column blocks (a row of 37 spans three, the last
ragged); the CuTeDSL kernels compile for sm_90a here (no GPU to run them) and their launches pass TVM-FFI's argument
checks. `pytest -m gpu` on a GPU host runs the same value tests at a real vocabulary, CuTeDSL included.
"""

import contextlib
import importlib.util
import sys

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import dispatch
from liger_dispatch.errors import InputError
from liger_dispatch.backends.reference import formulas

from kernel_checks import DEVICE, IGNORE, keep_some_slices, rel_err

ON_GPU = DEVICE == "cuda"
# an empty slice's lse is log(0) = -inf, which numpy in Triton's interpreter reports
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")]
C, V = (64, 32003) if ON_GPU else (6, 37)  # V a multiple of no block size
SLICES = (13000, 0, V - 13000) if ON_GPU else (13, 0, 24)  # one slice empty; vocab_start > 0 for the others
# fp32: the kernels' fp32 math against float64 on the same inputs; bf16: the gradient rounded to bf16 once
VALUE_TOL = 1e-5  # relative, with an absolute floor of the same size times the largest |value|
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def backends(op="logprobs_stats"):
    status = dispatch.backend_status(op, DEVICE, torch.float32)
    return [pytest.param(b, marks=() if status.get(b) is None else pytest.mark.skip(reason=status[b]))
            for b in ld.registered_backends(op)]


@pytest.fixture(autouse=True)
def small_blocks():
    """In the interpreter, Triton's and Helion's kernels stream 16-column blocks."""
    available = [] if ON_GPU else ld.available_backends("logprobs_stats", device=DEVICE)
    with contextlib.ExitStack() as stack:
        if "triton" in available:
            from liger_dispatch.backends.triton import logprobs as triton_logprobs

            stack.enter_context(triton_logprobs.LAUNCH.using(block_size=16))
        if "helion" in available:
            from liger_dispatch.backends.helion import logprobs as helion_logprobs

            config = {"block_sizes": [1, 16], "num_warps": 1, "num_stages": 1}
            for kernel in helion_logprobs.KERNELS:
                stack.enter_context(kernel.using(config))
        yield


def random_logits(rows, vocab, dtype, scale=4.0, pad=0):
    """Fresh random logits [rows, vocab]; with pad, a view into rows of vocab + pad whose padding holds 7.0."""
    buffer = torch.full((rows, vocab + pad), 7.0, device=DEVICE)
    buffer[:, :vocab] = torch.randn(rows, vocab, device=DEVICE) * scale
    return buffer.to(dtype)[:, :vocab]


def random_targets(rows, vocab, ignored=(1,)):
    out = torch.randint(0, vocab, (rows,), device=DEVICE)
    out[[i for i in ignored if i < rows]] = IGNORE
    return out


def upstream(rows, which):
    """A fresh random upstream gradient [rows] fp32 (a strided view when which == "strided"), or None."""
    if which is None:
        return None
    g = torch.randn(2 * rows, device=DEVICE)
    return g[::2] if which == "strided" else g[:rows].clone()


def truth(x, target, g, h, temperature):
    """float64 (logprobs, entropy) of formulas.logprobs_rows and the gradient of sum g logprobs + h entropy."""
    x64 = x.detach().double().requires_grad_()
    lp, ent = formulas.logprobs_rows(x64, target, temperature=temperature, ignore_index=IGNORE)
    loss = sum((u.double() * v).sum() for u, v in ((g, lp), (h, ent)) if u is not None)
    grad = torch.autograd.grad(loss, x64)[0] if torch.is_tensor(loss) else torch.zeros_like(x64)
    return lp.detach(), ent.detach(), grad


def assert_rel(name, got, want, tol):
    """Relative closeness with an absolute floor of tol * max |want|; NaN or inf never passes."""
    assert torch.isfinite(got).all(), f"{name}: not finite: {got}"
    floor = tol * max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=floor, msg=lambda m: f"{name}: {m}")


def stats_op(backend):
    return dispatch.op("logprobs_stats", backend=backend)


def grad_op(backend):
    return dispatch.op("logprobs_grad", backend=backend)


# A row shorter than one CTA's tile of a GPU kernel: most threads hold padding only (CuTeDSL summed it to NaN once)
SHORT_V = 37
CASES = {  # (dtype, temperature, g, h, rows, ignored rows[, vocabulary: V by default])
    "plain": (torch.float32, 1.0, "dense", "dense", C, (1,)),
    "short-rows": (torch.float32, 0.7, "dense", "dense", 8, (1,), SHORT_V),
    "short-rows-bf16": (torch.bfloat16, 0.7, "dense", "dense", 8, (1,), SHORT_V),
    "temperature": (torch.float32, 0.7, "strided", "dense", C, (1, 4)),
    "hot-no-entropy-grad": (torch.float32, 2.5, "dense", None, C, (0,)),
    "entropy-grad-only": (torch.float32, 0.7, None, "strided", C, (1,)),
    "no-upstream": (torch.float32, 1.3, None, None, C, (1,)),
    "single-row": (torch.float32, 0.7, "dense", "dense", 1, ()),
    "all-ignored": (torch.float32, 1.0, "dense", "dense", C, tuple(range(C))),
    "bf16": (torch.bfloat16, 0.7, "dense", "dense", C, (1,)),
    "bf16-no-entropy-grad": (torch.bfloat16, 1.0, "dense", None, C, (2,)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", backends())
def test_whole_vocabulary_matches_float64_autograd(backend, case):
    dtype, temperature, g_form, h_form, rows, ignored, *vocab = CASES[case]
    vocab = vocab[0] if vocab else V
    x = random_logits(rows, vocab, dtype, pad=5)  # a row stride wider than vocab: the padding must stay untouched
    target = random_targets(rows, vocab, ignored)
    g, h = upstream(rows, g_form), upstream(rows, h_form)
    want_lp, want_ent, want_grad = truth(x, target, g, h, temperature)

    stats = stats_op(backend)(x, target, temperature=temperature, ignore_index=IGNORE)
    assert stats.shape == (rows, 3) and stats.dtype == torch.float32
    ignored_rows = target == IGNORE
    assert (stats[ignored_rows] == 0).all(), "an ignored row's statistics are not 0"
    assert_rel("stats", stats, formulas.logprobs_stats(x.double(), target, temperature=temperature,
                                                       ignore_index=IGNORE), VALUE_TOL)
    lp, ent = formulas.logprobs_from_stats(stats, target, ignore_index=IGNORE)
    assert_rel("logprobs", lp, want_lp, VALUE_TOL)
    assert_rel("entropy", ent, want_ent, VALUE_TOL)

    # what the kernel overwrites: the logits themselves (random, never zeros, until it runs), in the same layout
    buffer = torch.full((rows, vocab + 5), 7.0, device=DEVICE, dtype=dtype)
    grad = buffer[:, :vocab]
    grad.copy_(x)
    grad_op(backend)(grad, target, stats, g, h, temperature=temperature, ignore_index=IGNORE)
    assert grad.dtype == dtype
    assert_rel("gradient", grad, want_grad, GRAD_TOL[dtype])
    assert (grad[ignored_rows] == 0).all(), "an ignored row's gradient is not 0"
    assert (buffer[:, vocab:] == 7.0).all(), "the kernel wrote past the row"


def columns(t, sizes):
    """(start, view of t's columns [start, start + size)) per slice."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(start, t[:, start:start + size]) for start, size in zip(starts, sizes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", backends())
def test_slices_combine_to_the_whole_vocabulary(backend, dtype):
    """Vocab-parallel use in one process: each slice's statistics, combined, are the whole vocabulary's; each slice's
    gradient from the combined statistics is its columns of the whole gradient."""
    temperature = 0.8
    x = random_logits(C, V, dtype)
    target = random_targets(C, V, ignored=(2,))
    target[0], target[3] = 5, V - 1  # row 0's target lies in the first slice only, row 3's in the last only
    g, h = upstream(C, "dense"), upstream(C, "dense")
    want_lp, want_ent, want_grad = truth(x, target, g, h, temperature)
    parts = columns(x, SLICES)

    per_slice = [stats_op(backend)(part, target, vocab_start=start, temperature=temperature, ignore_index=IGNORE)
                 for start, part in parts]
    for (start, part), stats in zip(parts, per_slice):
        local = target - start
        elsewhere = (target != IGNORE) & ((local < 0) | (local >= part.shape[1]))
        assert (stats[elsewhere, 1] == 0).all(), f"slice at {start}: z_target of a target held by another slice"
        want = formulas.logprobs_stats(part.double(), target, vocab_start=start, temperature=temperature,
                                       ignore_index=IGNORE)
        if part.shape[1] == 0:  # lse -inf: exactly the reference's
            assert torch.equal(stats.double(), want), f"empty slice at {start}: {stats}"
        else:
            assert_rel(f"stats of the slice at {start}", stats, want, VALUE_TOL)
    combined = formulas.combine_logprobs_stats(torch.stack(per_slice))
    whole = formulas.logprobs_stats(x.double(), target, temperature=temperature, ignore_index=IGNORE)
    valid = target != IGNORE
    assert_rel("combined stats", combined[valid], whole[valid], VALUE_TOL)
    lp, ent = formulas.logprobs_from_stats(combined, target, ignore_index=IGNORE)
    assert_rel("logprobs", lp, want_lp, VALUE_TOL)
    assert_rel("entropy", ent, want_ent, VALUE_TOL)

    grad = x.clone()
    for start, part in columns(grad, SLICES):
        grad_op(backend)(part, target, combined, g, h, vocab_start=start, temperature=temperature,
                         ignore_index=IGNORE)
    assert_rel("gradient", grad, want_grad, GRAD_TOL[dtype])


@pytest.mark.parametrize("backend", backends())
def test_empty_slice(backend):
    """No columns: lse -inf for the rows not ignored, 0 elsewhere; the gradient pass is a no-op."""
    target = torch.tensor([0, IGNORE, 7], device=DEVICE)
    empty = torch.empty(3, 0, device=DEVICE)
    inf = float("-inf")
    stats = stats_op(backend)(empty, target, vocab_start=5, temperature=0.5)
    assert torch.equal(stats.cpu(), torch.tensor([[inf, 0, 0], [0, 0, 0], [inf, 0, 0]]))
    grad_op(backend)(empty, target, torch.zeros(3, 3, device=DEVICE), torch.ones(3, device=DEVICE))


@pytest.mark.parametrize("backend", backends())
def test_strided_statistics(backend):
    """The global statistics as a strided view (a column block of a wider buffer) give the same gradient."""
    x, target = random_logits(C, V, torch.float32), random_targets(C, V)
    g, h = upstream(C, "dense"), upstream(C, "dense")
    stats = stats_op(backend)(x, target, temperature=0.9)
    wide = torch.full((C, 5), float("nan"), device=DEVICE)
    wide[:, 1:4] = stats
    want, got = x.clone(), x.clone()
    grad_op(backend)(want, target, stats, g, h, temperature=0.9)
    grad_op(backend)(got, target, wide[:, 1:4], g, h, temperature=0.9)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", backends())
def test_required_arguments_only(backend):
    """The schema's defaults (vocab_start 0, temperature 1, ignore_index -100, no upstream gradients) hold."""
    x = random_logits(C, V, torch.float32)
    target = random_targets(C, V, ignored=(1,))
    target[1] = -100
    stats = stats_op(backend)(x, target)
    assert_rel("stats", stats, formulas.logprobs_stats(x.double(), target), VALUE_TOL)
    grad = x.clone()
    grad_op(backend)(grad, target, stats)
    assert torch.equal(grad, torch.zeros_like(grad))  # no upstream gradient: 0 (the logits were overwritten)
    g = upstream(C, "dense")
    grad = x.clone()
    grad_op(backend)(grad, target, stats, g)
    assert_rel("gradient", grad, truth(x, target, g, None, 1.0)[2], GRAD_TOL[torch.float32])


# ---------------------------------------------------------------- the reference is the spec


def test_logprobs_rows_gradcheck():
    x = (torch.randn(4, 7, dtype=torch.float64) * 3).requires_grad_()
    target = torch.tensor([3, IGNORE, 0, 6])

    def both(z):
        lp, ent = formulas.logprobs_rows(z, target, temperature=0.7, ignore_index=IGNORE)
        return lp, ent

    assert torch.autograd.gradcheck(both, (x,))
    lp, ent = both(x)
    z = x.detach() / 0.7
    p = torch.softmax(z, -1)
    assert torch.allclose(lp[0], torch.log_softmax(z, -1)[0, 3]) and lp[1] == 0 and ent[1] == 0
    torch.testing.assert_close(ent[[0, 2, 3]], -(p * p.log()).sum(-1)[[0, 2, 3]])


@pytest.mark.parametrize("slices", ["all kept", "all kept in dW", "some kept", "none kept", "one"])
def test_user_op_reference_float64_is_the_spec(slices, monkeypatch):
    """fused_linear_logprobs on the reference kernels in float64 (3 vocabulary columns a slice, the last one
    narrower: every slice's logits kept from the forward, in a buffer of their own or in dW's memory, only the first
    ones, or none, the others recomputed in the backward; or one slice) against formulas.logprobs_rows on the logits (gradchecked above): values, and the
    gradients of random upstreams on both outputs and on each alone, to float64 rounding. Its backward overwrites
    the logits it kept, so a second backward through one call (what gradcheck does) is refused."""
    monkeypatch.setenv("LIGER_CHUNK_COLUMNS", "64" if slices == "one" else "3")
    if slices in ("some kept", "all kept in dW"):
        keep_some_slices(monkeypatch, 5, 4, 7, torch.float64, 3, every=slices == "all kept in dW")
    elif slices == "none kept":
        monkeypatch.setenv("LIGER_CHUNK_BUDGET_MB", "1e-9")
    op = dispatch.op("fused_linear_logprobs", backend="reference")
    leaves = [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in ((5, 4), (7, 4), (7,))]
    target = torch.tensor([3, IGNORE, 0, 6, 2])
    g, h = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    for used in ((0, 1), (0,), (1,)):
        got = op(*leaves[:2], target, leaves[2], temperature=0.7, ignore_index=IGNORE)
        want = formulas.logprobs_rows(torch.nn.functional.linear(*leaves), target, temperature=0.7,
                                      ignore_index=IGNORE)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        total = [sum((o * u).sum() for i, (o, u) in enumerate(zip(out, (g, h))) if i in used) for out in (got, want)]
        grads = [torch.autograd.grad(t, leaves, retain_graph=True) for t in total]
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="fused_linear_logprobs's backward overwrites .* backpropagated twice"):
        torch.autograd.grad(total[0], leaves)


@pytest.mark.parametrize("slices", ["all kept in dW", "some kept"])
def test_compiled_weight_gradient_is_the_buffer_not_a_copy(slices, monkeypatch):
    """Compiled (and through the torch op), with dW in the kept buffer's memory: the same gradients as eager, and the
    backward op returns dW empty (its autograd takes the view of the buffer the backward wrote), so no copy of dW."""
    monkeypatch.setenv("LIGER_CHUNK_COLUMNS", "3")
    keep_some_slices(monkeypatch, 5, 4, 7, torch.float64, 3, every=slices == "all kept in dW")
    op = dispatch.op("fused_linear_logprobs", backend="reference")
    x, w = torch.randn(5, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    target = torch.tensor([3, IGNORE, 0, 6, 2])
    g, h = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    grads = []
    for fn in (op, torch.compile(op, fullgraph=True, backend="aot_eager")):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        lp, ent = fn(*leaves, target, temperature=0.7, ignore_index=IGNORE)
        grads.append(torch.autograd.grad((lp * g).sum() + (ent * h).sum(), leaves))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)
    *_, stats, buffer = torch.ops.liger_dispatch.fused_linear_logprobs(x, w, target, temperature=0.7,
                                                                       ignore_index=IGNORE, backend="reference")
    dx, dw, db = torch.ops.liger_dispatch.fused_linear_logprobs_backward(
        x, w, target, None, stats, buffer, g, h, temperature=0.7, ignore_index=IGNORE, need_grads=[True, True, False],
        backend="reference")
    assert dx.shape == x.shape and dw.numel() == 0


@pytest.mark.parametrize("backend", backends())
def test_user_op_vocabulary_slices_match_float64(backend, monkeypatch):
    """Each backend's user op with the vocabulary cut into slices of 16 columns (the last one narrower, the first
    ones' logits kept from the forward, the others recomputed) against the float64 formula: values and the gradients
    of random upstreams on both outputs. dW comes one GEMM per slice, so it is as close as the one-slice op's."""
    rows, hidden = 8, 4  # more rows than hidden: a slice's logits are larger than its dW, not all fit
    keep_some_slices(monkeypatch, rows, hidden, V, torch.float32, 16)
    x, w, b = (torch.randn(*shape, device=DEVICE) for shape in ((rows, hidden), (V, hidden), (V,)))
    target = random_targets(rows, V, ignored=(2,))
    g, h = upstream(rows, "dense"), upstream(rows, "dense")
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    got = dispatch.op("fused_linear_logprobs", backend=backend)(*leaves[:2], target, leaves[2], temperature=0.7)
    wide = [t.double().requires_grad_() for t in (x, w, b)]
    want = formulas.logprobs_rows(torch.nn.functional.linear(*wide), target, temperature=0.7, ignore_index=IGNORE)
    for name, o, u in zip(("logprobs", "entropy"), got, want):
        assert_rel(name, o, u, VALUE_TOL)
    grads = [torch.autograd.grad((out[0] * g.to(out[0].dtype)).sum() + (out[1] * h.to(out[1].dtype)).sum(), ins)
             for out, ins in ((got, leaves), (want, wide))]
    for name, o, u in zip(("input", "weight", "bias"), *grads):
        assert_rel(f"grad {name}", o, u, GRAD_TOL[torch.float32])


def test_reference_keeps_float64_and_its_closed_form_is_autograd():
    x = torch.randn(5, 9, dtype=torch.float64) * 3
    target = random_targets(5, 9, ignored=(2,)).cpu()
    g, h = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    stats = stats_op("reference")(x, target, temperature=1.7)
    assert stats.dtype == torch.float64
    grad = x.clone()
    grad_op("reference")(grad, target, stats, g, h, temperature=1.7)
    torch.testing.assert_close(grad, truth(x, target, g, h, 1.7)[2], rtol=1e-12, atol=1e-12)


def test_combine_weighs_each_slice_by_its_softmax_mass():
    z = torch.randn(4, 10, dtype=torch.float64) * 3
    target = torch.tensor([1, 9, 4, IGNORE])
    parts = [formulas.logprobs_stats(z[:, a:b], target, vocab_start=a) for a, b in ((0, 3), (3, 3), (3, 10))]
    combined = formulas.combine_logprobs_stats(torch.stack(parts))
    torch.testing.assert_close(combined[:3], formulas.logprobs_stats(z, target)[:3])
    assert formulas.logprobs_from_stats(combined, target)[1][3] == 0  # ignored: (log 3, 0, 0) combined, masked


def test_checks_name_the_argument():
    x, target = torch.randn(3, 8), torch.tensor([1, 2, IGNORE])
    stats = stats_op("reference")(x, target)
    bad = {
        "stats": lambda: grad_op("reference")(x.clone(), target, stats[:, :2]),
        "grad_logprobs": lambda: grad_op("reference")(x.clone(), target, stats, torch.ones(4)),
        "grad_entropy": lambda: grad_op("reference")(x.clone(), target, stats, None, torch.ones(3, dtype=torch.int64)),
        "temperature": lambda: stats_op("reference")(x, target, temperature=0.0),
        "target": lambda: stats_op("reference")(x, target[:2]),
        "vocab_start": lambda: stats_op("reference")(x, target, vocab_start=-1),
    }
    for name, call in bad.items():
        with pytest.raises(InputError, match=name):
            call()


# ---------------------------------------------------------------- CuTeDSL: compiled on the CPU, run on a GPU


CUTLASS = importlib.util.find_spec("cutlass") is not None
needs_cutlass = pytest.mark.skipif(not CUTLASS, reason="nvidia-cutlass-dsl (cutlass) is not importable")


def _cutedsl_variants():
    if not CUTLASS:
        return []
    from liger_dispatch.backends.cutedsl import logprobs as cute_logprobs
    from liger_dispatch.backends.cutedsl._row import RowLaunch

    default = cute_logprobs.LAUNCH.default
    i64, i32 = torch.int64, torch.int32
    return [  # the widest register footprint of each kernel, and the other launch shapes and flags
        ("_stats_compiled", (torch.bfloat16, i64, 8, default)),
        ("_grad_compiled", (torch.bfloat16, i64, 8, default, True, True)),
        ("_grad_compiled", (torch.float32, i32, 1, RowLaunch(threads=1024, unroll=2, l2_hints=False), False, True)),
    ]


@needs_cutlass
@pytest.mark.parametrize("cache, key", _cutedsl_variants(),
                         ids=[f"{c[1:]}{i}" for i, (c, _) in enumerate(_cutedsl_variants())])
def test_cutedsl_kernels_compile_for_sm90a_without_spills(cache, key, tmp_path, monkeypatch):
    from liger_dispatch.backends.cutedsl import logprobs as cute_logprobs
    from cutedsl_checks import check_compiled

    monkeypatch.setenv("LIGER_CUTEDSL_DUMP_DIR", str(tmp_path))
    check_compiled(getattr(cute_logprobs, cache).__wrapped__(*key))  # bypass the process cache


@needs_cutlass
def test_cutedsl_registered_after_triton_with_one_capability():
    from liger_dispatch.backends.cutedsl import logprobs as cute_logprobs
    from cutedsl_checks import cutedsl_impl

    for op in ("logprobs_stats", "logprobs_grad"):
        impl = cutedsl_impl(op)
        assert impl.fn is getattr(cute_logprobs, op) and impl.capability == cute_logprobs.CAPABILITY
        assert impl.priority == cute_logprobs.UNTESTED_PRIORITY


@needs_cutlass
@pytest.mark.skipif(importlib.util.find_spec("tvm_ffi") is None, reason="apache-tvm-ffi is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="presents CPU memory as cuda:0, which must not reach a real GPU")
def test_cutedsl_tvm_ffi_accepts_every_call_the_wrappers_make():
    from cutedsl_checks import run_probe

    run_probe(__file__)


def _probe_calls():
    """Child of test_cutedsl_tvm_ffi_accepts_every_call_the_wrappers_make: each op through the input forms it takes."""
    from liger_dispatch.backends.cutedsl import logprobs as cute_logprobs
    from cutedsl_checks import validate_only

    for cache in ("_stats_compiled", "_grad_compiled"):
        setattr(cute_logprobs, cache, validate_only(getattr(cute_logprobs, cache)))
    torch.manual_seed(0)
    rows = 6
    y = torch.tensor([0, IGNORE, 2, 300, 4, 5])
    wide = lambda vocab, pad, dtype: torch.randn(rows, vocab + pad).to(dtype)[:, :vocab]  # noqa: E731
    stats = torch.randn(rows, 3)
    calls = [
        lambda: cute_logprobs.logprobs_stats(wide(1000, 0, torch.bfloat16), y, vocab_start=200, temperature=0.7),
        lambda: cute_logprobs.logprobs_stats(wide(1001, 3, torch.float32), y.int()),
        lambda: cute_logprobs.logprobs_grad(wide(1000, 8, torch.bfloat16), y, stats, torch.randn(rows),
                                            torch.randn(2 * rows)[::2], vocab_start=200, temperature=0.7),
        lambda: cute_logprobs.logprobs_grad(wide(64, 0, torch.float16), y.int(), torch.randn(rows, 5)[:, 1:4],
                                            None, torch.randn(rows)),
        lambda: cute_logprobs.logprobs_grad(wide(300, 0, torch.float32), y, stats, torch.randn(rows)),
        lambda: cute_logprobs.logprobs_grad(wide(300, 0, torch.bfloat16), y, stats),
    ]
    for call in calls:
        call()
    print(f"validated {len(calls)} calls")
    return 0


if __name__ == "__main__":
    sys.exit(_probe_calls())


@pytest.mark.parametrize("rows, hidden, vocab, dtype, weight_dtype, budget_mb, columns", [
    (4096, 4096, 128256, torch.bfloat16, torch.bfloat16, None, None),
    (16384, 4096, 128256, torch.bfloat16, torch.bfloat16, None, None),
    (8192, 4096, 128256, torch.float16, torch.float16, None, None),  # fp16: dW in fp32, twice the logits' bytes
    (1000, 64, 5003, torch.float32, torch.float32, 0.5, 100),
    (3, 64, 5003, torch.bfloat16, torch.bfloat16, 1e-9, 128),
    (7, 5, 0, torch.float32, torch.float32, None, None),
    (2048, 4096, 128256, torch.bfloat16, torch.bfloat16, None, None),  # fits the budget alone: a buffer of its own
    (64, 64, 5003, torch.float32, torch.float32, None, 128),
])
def test_layout_keeps_logits_where_dw_goes_later(rows, hidden, vocab, dtype, weight_dtype, budget_mb, columns,
                                                monkeypatch):
    """vocab_chunks.layout: no kept slice overlaps another, the recompute slice or a slice of dW written before it is
    read (dW's slices 0..j for slice j); the recompute slice lies past dW; the buffer holds dW unless the logits
    alone fit the budget; with the default budget it stays within dW's size plus the budget, and N <= H in one
    dtype keeps every slice."""
    from liger_dispatch.compose import vocab_chunks

    for name, value in (("LIGER_CHUNK_BUDGET_MB", budget_mb), ("LIGER_CHUNK_COLUMNS", columns)):
        if value is not None:
            monkeypatch.setenv(name, str(value))
    x = torch.empty(rows, hidden, dtype=dtype, device="meta")
    w = torch.empty(vocab, hidden, dtype=weight_dtype, device="meta")
    plan = vocab_chunks.layout(x, w)
    grad_size = 4 if weight_dtype == torch.float16 else w.element_size()
    logits_bytes = rows * vocab * x.element_size()
    shared = logits_bytes > (512 * 2**20 if budget_mb is None else budget_mb * 2**20)
    assert plan.grad_bytes == (vocab * hidden * grad_size if shared else 0) <= plan.nbytes
    spans = [(o, o + rows * (e - s) * x.element_size()) for o, (s, e) in zip(plan.offsets, plan.slices)]
    if len(plan.offsets) < len(plan.slices):
        widest = max(e - s for s, e in plan.slices)
        spans.append((plan.recompute, plan.recompute + rows * widest * x.element_size()))
        assert plan.recompute >= plan.grad_bytes
    for j, (start, end) in enumerate(spans):
        assert end <= plan.nbytes and start % vocab_chunks.BYTE_ALIGN == 0
        assert all(end <= s or e <= start for s, e in spans[:j]), (j, spans)
        if j < len(plan.offsets) and shared:
            assert start >= plan.slices[j][1] * hidden * grad_size
    if budget_mb is None:
        several = len(plan.slices) > 1
        assert plan.nbytes <= plan.grad_bytes + 512 * 2**20 - (rows * hidden * 4 if several and shared else 0)
        if rows <= hidden and grad_size == x.element_size():
            assert len(plan.offsets) == len(plan.slices)
    covered = sorted(spans + plan.gaps())
    assert covered[0][0] == 0 and covered[-1][1] == plan.nbytes or plan.nbytes == 0
    assert all(a[1] >= b[0] for a, b in zip(covered, covered[1:]))


@pytest.mark.parametrize("compiled", [False, True])
def test_frozen_head_makes_no_weight_gradient(compiled, monkeypatch):
    """A head that needs no gradient (LoRA, a frozen LM head): input's gradient as with a trained head, none for the
    weight, and none of the backward's GEMMs writes a dW slice (its 2 N H V FLOPs), in eager and compiled code."""
    from liger_dispatch.compose import vocab_chunks

    written = []
    mm = vocab_chunks._mm_into
    monkeypatch.setattr(vocab_chunks, "_mm_into", lambda a, b, out, **kw: (written.append(tuple(out.shape)),
                                                                            mm(a, b, out, **kw)))
    x, w = torch.randn(6, 8, device=DEVICE), torch.randn(V, 8, device=DEVICE)
    target = random_targets(6, V)
    g, h = upstream(6, "dense"), upstream(6, "dense")
    op = dispatch.op("fused_linear_logprobs", backend="reference")
    fn = torch.compile(op, fullgraph=True) if compiled else op
    grads = []
    for frozen in (False, True):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_(not frozen)]
        written.clear()
        lp, ent = fn(*leaves, target)
        ((lp * g).sum() + (ent * h).sum()).backward()
        grads.append(leaves[0].grad)
        assert (leaves[1].grad is None) == frozen
    assert written and all(shape == (6, 8) for shape in written), written
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", backends())
def test_vocabulary_slices_round_the_gradients_once(backend, monkeypatch):
    """bf16 with several vocabulary slices (dX summed over them in fp32, each slice of dW one GEMM) against float64:
    no further from it than the one-slice op, whose gradients are rounded once each, as torch's matmul rounds them.
    (The benchmark's error column compares with torch's own bf16 result, not with float64.)"""
    rows, hidden, vocab, columns = (512, 64, 4099, 512) if ON_GPU else (24, 8, 61, 16)
    x = torch.randn(rows, hidden, device=DEVICE).bfloat16()
    w = (torch.randn(vocab, hidden, device=DEVICE) * hidden ** -0.5 * 3).bfloat16()
    target = random_targets(rows, vocab, ignored=(3,))
    g, h = upstream(rows, "dense"), upstream(rows, "dense")
    wide = [t.double().requires_grad_() for t in (x, w)]
    want = formulas.logprobs_rows(torch.nn.functional.linear(*wide), target, temperature=0.9, ignore_index=IGNORE)
    want = torch.autograd.grad((want[0] * g.double()).sum() + (want[1] * h.double()).sum(), wide)
    op = dispatch.op("fused_linear_logprobs", backend=backend)
    errors = {}
    for slices in ("one", "several"):
        if slices == "several":
            keep_some_slices(monkeypatch, rows, hidden, vocab, torch.bfloat16, columns)
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        lp, ent = op(*leaves, target, temperature=0.9)
        got = torch.autograd.grad((lp * g).sum() + (ent * h).sum(), leaves)
        errors[slices] = [rel_err(a, b) for a, b in zip(got, want)]
    for name, one, several in zip(("input", "weight"), errors["one"], errors["several"]):
        assert several <= 1.25 * one + 1e-6, f"grad {name}: {several:.2e} with slices, {one:.2e} without"
