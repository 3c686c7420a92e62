"""The vocab-parallel kernel-level ops of every registered backend that can run here, driven by the registry: the
vocabulary is cut into slices in one process (as ranks would hold it, one slice empty), each slice's statistics
pass runs, the statistics are combined as the driver combines them, and each slice's gradient pass writes its
columns. The loss rows and the gradient must be the single-vocabulary formulas' (float64 truth). One slice is the
contract's first test: stats + combine + grad equal the ce / jsd / kl_div_loss_and_grad rows and gradients.

On the CPU the shapes are tiny and Triton runs in its interpreter with 64-byte blocks, so that a slice spans
several ragged blocks; on a GPU host (`pytest -m gpu`) the same tests run at the llama3 vocabulary, plus a chunk
whose C * V exceeds 2^31.
"""

import contextlib

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import dispatch
from liger_dispatch.compose import vocab_parallel
from liger_dispatch.registry import cross_entropy, kl_div
from liger_dispatch.errors import InputError
from liger_dispatch.backends.reference.formulas import ce_row_stats, ce_rows, jsd_rows, kl_div_rows

from kernel_checks import DEVICE, IGNORE, assert_rel_close, check, grad_scale, inputs, reference
from vp_checks import check_empty_slice

ON_GPU = DEVICE == "cuda"
# an empty slice's lse is log(0) = -inf, which numpy in Triton's interpreter reports
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")]
if ON_GPU:
    pytestmark.append(pytest.mark.gpu)
C, V = (64, 128256) if ON_GPU else (6, 37)
SLICES = {"one-rank": (V,), "uneven": (50000, 0, V - 50000) if ON_GPU else (13, 0, 24)}
logits, labels = inputs(C, V)


def backends(op):
    status = dispatch.backend_status(op, DEVICE, torch.float32)
    return [pytest.param(b, marks=() if status.get(b) is None else pytest.mark.skip(reason=status[b]))
            for b in ld.registered_backends(op)]


@pytest.fixture(autouse=True)
def small_blocks():
    """In the interpreter, Triton's and Helion's kernels stream 16-column blocks: a slice spans several, the last
    ragged."""
    available = [] if ON_GPU else ld.available_backends("ce_vp_stats", device=DEVICE)
    with contextlib.ExitStack() as stack:
        if "triton" in available:
            from liger_dispatch.backends.triton import vocab_parallel as triton_vp

            stack.enter_context(triton_vp.LAUNCH.using(block_size=16))
        if "helion" in available:
            from liger_dispatch.backends.helion import vocab_parallel as helion_vp

            config = {"block_sizes": [1, 16], "num_warps": 1, "num_stages": 1}
            for kernel in helion_vp.KERNELS:
                stack.enter_context(kernel.using(config))
        yield


def columns(t, sizes):
    """(start, view of t's columns [start, start + size)) per slice."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(start, t[:, start:start + size]) for start, size in zip(starts, sizes)]


def run_ce(backend, x, target, sizes, scale, ce_weight=None, row_stats=None, **options):
    """ce over the slices of x: the loss rows (and row_stats, when given, written); x is overwritten with the
    gradient."""
    parts = columns(x, sizes)
    stats = vocab_parallel.combine(torch.stack([
        dispatch.op("ce_vp_stats", backend=backend)(part, target, vocab_start=start, ignore_index=IGNORE,
                                                    softcap=options.get("softcap"), ce_weight=ce_weight)
        for start, part in parts]), lse_columns=1, max_columns=1)
    for start, part in parts:
        dispatch.op("ce_vp_grad", backend=backend)(part, target, stats, vocab_start=start, vocab_size=x.shape[1],
                                                  grad_scale=scale, ignore_index=IGNORE, ce_weight=ce_weight,
                                                  **options)
    if row_stats is not None:
        cross_entropy.write_row_stats(row_stats, stats, target != IGNORE)
    return cross_entropy.loss_rows(stats, target, ce_weight, vocab_size=x.shape[1], ignore_index=IGNORE,
                                  label_smoothing=options.get("label_smoothing", 0.0),
                                  lse_square_scale=options.get("lse_square_scale", 0.0))


def run_jsd(backend, student, teacher, lab, sizes, scale, *, beta, temperature):
    """jsd over the slices: the loss rows; student is overwritten with the gradient."""
    pairs = [(s, t) for (_, s), (_, t) in zip(columns(student, sizes), columns(teacher, sizes))]
    common = dict(ignore_index=IGNORE, temperature=temperature)
    lse = vocab_parallel.combine(torch.stack([
        dispatch.op("jsd_vp_stats", backend=backend)(s, t, lab, **common) for s, t in pairs]), lse_columns=2)
    sums = torch.stack([dispatch.op("jsd_vp_sums", backend=backend)(s, t, lse, lab, beta=beta, **common)
                        for s, t in pairs]).sum(0)
    for s, t in pairs:
        dispatch.op("jsd_vp_grad", backend=backend)(s, t, lse, sums, lab, beta=beta, grad_scale=scale, **common)
    return sums[:, 0]


def run_kl(backend, student, target, lab, sizes, scale, *, temperature=1.0, eps=1e-10, log_target=False):
    """kl_div over the slices: the loss rows; student is overwritten with the gradient."""
    pairs = [(s, q) for (_, s), (_, q) in zip(columns(student, sizes), columns(target, sizes))]
    common = dict(ignore_index=IGNORE, temperature=temperature, log_target=log_target)
    stats = vocab_parallel.combine(torch.stack([
        dispatch.op("kl_div_vp_stats", backend=backend)(s, q, lab, eps=eps, **common) for s, q in pairs]),
        lse_columns=1)
    for s, q in pairs:
        dispatch.op("kl_div_vp_grad", backend=backend)(s, q, stats[:, 0], stats[:, 1], lab, grad_scale=scale, **common)
    return kl_div.loss_rows(stats)


def probabilities(log_target=False, zeros=True, dtype=torch.float32):
    """KL targets with exact zeros in every fifth column (so in every slice), or their logs."""
    p = torch.softmax(torch.randn(C, V, device=DEVICE) * 2.0, dim=-1)
    if zeros:
        p[:, ::5] = 0.0
        p = p / p.sum(-1, keepdim=True)
    return (p.clamp_min(1e-30).log() if log_target else p).to(dtype)


CE_OPTIONS = {
    "plain": dict(),
    "smoothing": dict(label_smoothing=0.1),
    "softcap-zloss": dict(softcap=3.0, lse_square_scale=1e-2),
    "everything": dict(label_smoothing=0.2, softcap=2.0, lse_square_scale=1e-3),
    "class-weights": dict(label_smoothing=0.2, lse_square_scale=1e-3, weighted=True),
    "class-weights-softcap": dict(softcap=2.0, weighted=True),
}


@pytest.mark.parametrize("slices", list(SLICES))
@pytest.mark.parametrize("options", list(CE_OPTIONS))
@pytest.mark.parametrize("backend", backends("ce_vp_stats"))
def test_ce(backend, options, slices):
    """The loss rows and gradient, and the rows' (lse, target is the max) as the composition writes them."""
    opts, scale = dict(CE_OPTIONS[options]), grad_scale("per-row", C)
    if opts.pop("weighted", False):
        opts["ce_weight"] = torch.rand(V, device=DEVICE) * 2 + 0.2
    x, target = logits(), labels(ignored=(1,))
    target[0], target[2] = 0, V - 1  # targets in the first and in the last slice
    target[4] = x[4].argmax()  # a row whose target is its max
    expected_stats = ce_row_stats(x, target, ignore_index=IGNORE, softcap=opts.get("softcap"))
    expected = reference(lambda z: ce_rows(z, target, ignore_index=IGNORE, **opts), x, scale)
    row_stats = torch.empty(C, 2, device=DEVICE)
    check(run_ce(backend, x, target, SLICES[slices], scale, row_stats=row_stats, **opts), x, *expected)
    assert torch.equal(row_stats[:, 1], expected_stats[:, 1]) and row_stats[4, 1] == 1
    assert_rel_close("lse", row_stats[:, 0], expected_stats[:, 0], 1e-6)


@pytest.mark.parametrize("slices", list(SLICES))
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("backend", backends("jsd_vp_stats"))
def test_jsd(backend, beta, temperature, slices):
    student, teacher, lab = logits(), logits(), labels(ignored=(2,)) if beta != 0.5 else None
    scale = grad_scale("0-d", C)
    expected = reference(lambda s: jsd_rows(s, teacher, lab, beta=beta, ignore_index=IGNORE, temperature=temperature),
                         student, scale)
    check(run_jsd(backend, student, teacher, lab, SLICES[slices], scale, beta=beta, temperature=temperature),
          student, *expected)


@pytest.mark.parametrize("slices", list(SLICES))
@pytest.mark.parametrize("log_target,zeros,temperature,eps", [(False, True, 1.0, 1e-10), (True, False, 2.0, 1e-10),
                                                              (False, True, 0.5, 1e-3)])
@pytest.mark.parametrize("backend", backends("kl_div_vp_stats"))
def test_kl_div(backend, log_target, zeros, temperature, eps, slices):
    student, target, lab = logits(), probabilities(log_target, zeros), labels(ignored=(3,))
    scale = grad_scale("per-row", C)
    options = dict(temperature=temperature, eps=eps, log_target=log_target)
    expected = reference(lambda s: kl_div_rows(s, target, lab, ignore_index=IGNORE, **options), student, scale)
    check(run_kl(backend, student, target, lab, SLICES[slices], scale, **options), student, *expected)


@pytest.mark.parametrize("family", ["ce", "jsd", "kl_div"])
@pytest.mark.parametrize("backend", backends("ce_vp_stats"))
def test_all_rows_ignored(backend, family):
    """Every row ignored: zero loss rows and a zero gradient over every slice (the logits were random)."""
    x, everything = logits(), labels(ignored=range(C))
    sizes = SLICES["uneven"]
    if family == "ce":
        loss = run_ce(backend, x, everything, sizes, None, label_smoothing=0.1)
    elif family == "jsd":
        loss = run_jsd(backend, x, logits(), everything, sizes, None, beta=0.5, temperature=2.0)
    else:
        loss = run_kl(backend, x, probabilities(), everything, sizes, None)
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(x, torch.zeros_like(x))


@pytest.mark.parametrize("backend", backends("ce_vp_stats"))
def test_empty_slice(backend):
    """A slice of no columns alone: -inf log-sum-exp on the rows not ignored, zeros elsewhere, no-op gradients."""
    check_empty_slice(lambda op: dispatch.op(op, backend=backend), DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", backends("ce_vp_stats"))
def test_low_precision(backend, dtype):
    """bf16 / fp16 logits: fp32 statistics, the gradient rounded once to the dtype."""
    sizes, scale = SLICES["uneven"], grad_scale("0-d", C)
    x, target = logits(dtype=dtype), labels()
    expected = reference(lambda z: ce_rows(z, target, ignore_index=IGNORE, label_smoothing=0.1), x, scale)
    check(run_ce(backend, x, target, sizes, scale, label_smoothing=0.1), x, *expected)
    student, teacher = logits(dtype=dtype), logits(dtype=dtype)
    expected = reference(lambda s: jsd_rows(s, teacher, None, beta=0.5, temperature=1.0), student, scale)
    check(run_jsd(backend, student, teacher, None, sizes, scale, beta=0.5, temperature=1.0), student, *expected)
    student, target = logits(dtype=dtype), probabilities(dtype=dtype)
    expected = reference(lambda s: kl_div_rows(s, target, None), student, scale)
    check(run_kl(backend, student, target, None, sizes, scale), student, *expected)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("backend", backends("ce_vp_stats"))
def test_ce_chunk_past_2_31_elements(backend):
    """One bf16 slice of 16,800 x 128,256 logits (C * V > 2^31): 64-bit row offsets. The last rows, which only
    64-bit offsets reach, against the formulas on those rows alone."""
    rows, vocab = 16800, 128256
    x = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device=DEVICE)
    tail = slice(rows - 4, rows)
    expected = reference(lambda z: ce_rows(z, target[tail], ignore_index=IGNORE), x[tail])
    loss = run_ce(backend, x, target, (vocab,), None)
    check(loss[tail], x[tail], *expected)


@pytest.mark.parametrize("backend", backends("ce_vp_stats"))
def test_opcheck(backend):
    """The seven ops as torch ops, torch.ops.liger_dispatch.<op> (torch.library.opcheck: schema, fake, aliasing),
    on a slice [5, 5 + 24) of a vocabulary of V + 10."""
    x, target, scale = logits(vocab=24), labels(vocab=V), grad_scale("per-row", C)
    teacher, probs, lab = logits(vocab=24), probabilities()[:, :24].contiguous(), labels(vocab=V, ignored=(2,))
    weights = torch.rand(V + 10, device=DEVICE) + 0.5
    stats = vocab_parallel.combine(torch.ops.liger_dispatch.ce_vp_stats(x, target, vocab_start=5)[None], 1, 1)
    jsd_lse = vocab_parallel.combine(torch.ops.liger_dispatch.jsd_vp_stats(x, teacher, lab)[None], 2)
    kl = vocab_parallel.combine(torch.ops.liger_dispatch.kl_div_vp_stats(x, probs, lab)[None], 1)
    cases = [
        ("ce_vp_stats", (x, target), dict(vocab_start=5, softcap=3.0)),
        ("ce_vp_stats", (x, target), dict(vocab_start=5, ce_weight=weights)),
        ("ce_vp_grad", (x.clone(), target, stats),
         dict(vocab_start=5, vocab_size=V + 10, grad_scale=scale, label_smoothing=0.1)),
        ("ce_vp_grad", (x.clone(), target, stats),
         dict(vocab_start=5, vocab_size=V + 10, grad_scale=scale, label_smoothing=0.1, ce_weight=weights)),
        ("jsd_vp_stats", (x, teacher, lab), dict(temperature=2.0)),
        ("jsd_vp_sums", (x, teacher, jsd_lse, lab), dict(beta=0.3)),
        ("jsd_vp_grad", (x.clone(), teacher, jsd_lse, torch.rand(C, 2, device=DEVICE), lab), dict(beta=0.3, grad_scale=scale)),
        ("kl_div_vp_stats", (x, probs, lab), dict(eps=1e-8)),
        ("kl_div_vp_grad", (x.clone(), probs, kl[:, 0].contiguous(), kl[:, 1].contiguous(), lab), dict(grad_scale=scale)),
    ]
    for op, args, kwargs in cases:
        result = torch.library.opcheck(getattr(torch.ops.liger_dispatch, op).default, args,
                                       dict(kwargs, backend=backend))
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


def test_bad_inputs_name_the_argument():
    x, target, lse = logits(vocab=24), labels(), torch.zeros(C, device=DEVICE)
    cases = [
        ("ce_vp_grad", (x, target, torch.zeros(C + 1, 5, device=DEVICE)), {}, "stats must be float32 of shape"),
        ("ce_vp_grad", (x, target, torch.zeros(C, 5, device=DEVICE)), dict(vocab_start=5, vocab_size=20),
         "slice ends at column 29"),
        ("ce_vp_stats", (x, target), dict(vocab_start=5, ce_weight=torch.ones(28, device=DEVICE)),
         "ce_weight holds 28 class weights but the slice ends at class 29"),
        ("ce_vp_stats", (x, target), dict(vocab_start=-1), "vocab_start must be >= 0"),
        ("jsd_vp_stats", (x, logits(vocab=23)), {}, "teacher_logits has shape"),
        ("jsd_vp_grad", (x, x, torch.zeros(C, 2, device=DEVICE), lse), {}, "sums must be float32 of shape"),
        ("kl_div_vp_grad", (x, x, lse, lse[:-1]), {}, "target_sum must be float32 of shape"),
    ]
    for op, args, kwargs, message in cases:
        with pytest.raises(InputError, match=message):
            dispatch.op(op, backend="reference")(*args, **kwargs)
