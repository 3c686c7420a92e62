"""The Triton loss kernels beyond what the registry-driven conformance suite covers: several blocks a row with a
ragged last one, row strides wider than V, every grad_scale form, mixed options, dtypes, inputs never written.

On the CPU they run under TRITON_INTERPRET=1 with tiny shapes and forced small blocks; `pytest -m gpu` adds the
real vocabularies and a chunk whose C * V exceeds 2^31.
"""

import os

import pytest
import torch

from liger_dispatch.backends.reference.formulas import ce_rows, jsd_rows, kl_div_rows
from liger_dispatch.backends.triton import _support, ce, jsd, kl_div
from liger_dispatch.backends.triton.ce import ce_loss_and_grad
from liger_dispatch.backends.triton.jsd import jsd_loss_and_grad
from liger_dispatch.backends.triton.kl_div import kl_div_loss_and_grad

from kernel_checks import DEVICE, GRAD_SCALE_FORMS, IGNORE, check, grad_scale, inputs, reference

C, V, BLOCK = 6, 300, 64  # 5 blocks a row, the last holding 44 columns
logits, labels = inputs(C, V)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_rows(module, kernel, rows_fn, x, *others, grad_scale=None, block=BLOCK, **options):
    """kernel(x, *others) in blocks of `block` columns (None: its own choice) against the formula rows_fn: the loss
    and the gradient written over x; others unchanged."""
    before = [None if o is None else o.clone() for o in others]
    expected = reference(lambda z: rows_fn(z, *others, ignore_index=IGNORE, **options), x, grad_scale)
    with module.LAUNCH.using(block_size=block):
        loss = kernel(x, *others, grad_scale=grad_scale, ignore_index=IGNORE, **options)
    check(loss, x, *expected)
    for o, b in zip(others, before):
        assert o is None or torch.equal(o, b)


def run_ce(x, target, grad_scale=None, block=BLOCK, **options):
    run_rows(ce, ce_loss_and_grad, ce_rows, x, target, grad_scale=grad_scale, block=block, **options)


def run_jsd(student, teacher, lab, grad_scale=None, block=BLOCK, **options):
    run_rows(jsd, jsd_loss_and_grad, jsd_rows, student, teacher, lab, grad_scale=grad_scale, block=block, **options)


def run_kl(student, target, lab, grad_scale=None, block=BLOCK, **options):
    run_rows(kl_div, kl_div_loss_and_grad, kl_div_rows, student, target, lab, grad_scale=grad_scale, block=block,
             **options)


def probabilities(rows=C, vocab=V, dtype=torch.float32, zeros=20):
    """Target probabilities with exact zeros in the first `zeros` columns."""
    p = torch.softmax(torch.randn(rows, vocab, device=DEVICE) * 3.0, dim=-1)
    p[:, :zeros] = 0.0
    return (p / p.sum(-1, keepdim=True)).to(dtype)


def grad_scale_of(form):
    return grad_scale(form, C)


# ---------------------------------------------------------------- several blocks, ragged last block, row strides


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row_stride", [None, V + 37])
def test_ce_blocks_and_row_stride(dtype, row_stride):
    x = logits(dtype=dtype, row_stride=row_stride)
    run_ce(x, labels())
    if row_stride:
        assert bool((x.as_strided((C, row_stride), (row_stride, 1))[:, V:] == 7.0).all()), "padding was written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_jsd_blocks_and_row_stride(dtype):
    student, teacher = logits(dtype=dtype, row_stride=V + 13), logits(dtype=dtype, row_stride=V + 5)
    run_jsd(student, teacher, labels(), beta=0.5, temperature=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_blocks_and_row_stride(dtype):
    run_kl(logits(dtype=dtype, row_stride=V + 21), probabilities(dtype=dtype), labels())


def test_max_moving_every_block():
    """Rows that grow along V move the running max in every block, so every block rescales the sums."""
    ramp = torch.linspace(-30.0, 30.0, V, device=DEVICE).expand(C, V) + torch.randn(C, V, device=DEVICE)
    run_ce(ramp.clone(), labels(ignored=()), label_smoothing=0.1)
    run_jsd(ramp.clone(), ramp.flip(-1).contiguous(), None, beta=0.0)
    run_jsd(ramp.clone(), ramp.flip(-1).contiguous(), None, beta=1.0)
    run_kl(ramp.clone(), probabilities(), None)


def test_strided_labels_and_single_block():
    target = labels(rows=2 * C)[::2]
    run_ce(logits(), target, block=512)  # one block covers the row


# ---------------------------------------------------------------- grad_scale: None, 0-d, per row, expanded view


@pytest.mark.parametrize("form", GRAD_SCALE_FORMS)
def test_grad_scale_forms(form):
    scale = grad_scale_of(form)
    run_ce(logits(), labels(), scale)
    run_jsd(logits(), logits(), labels(), scale, beta=0.3, temperature=1.5)
    run_kl(logits(), probabilities(), labels(), scale, temperature=1.5)


# ---------------------------------------------------------------- ignored rows


def test_all_rows_ignored():
    everything = tuple(range(C))
    for run, x, args in [
        (run_ce, logits(), (labels(ignored=everything),)),
        (run_jsd, logits(), (logits(), labels(ignored=everything))),
        (run_kl, logits(), (probabilities(), labels(ignored=everything))),
    ]:
        options = {"beta": 0.5} if run is run_jsd else {}
        run(x, *args, grad_scale_of("0-d"), **options)
        assert bool((x == 0).all())


def test_empty_chunk():
    x = logits(rows=0)
    assert ce_loss_and_grad(x, labels(rows=0, ignored=())).shape == (0,)


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ce_softcap_smoothing_and_z_loss_together(dtype):
    x = logits(dtype=dtype, scale=20.0)  # softcap 30 bends these
    run_ce(x, labels(ignored=(0, 3)), grad_scale_of("per-row"), softcap=30.0, label_smoothing=0.1,
           lse_square_scale=1e-2)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_jsd_beta_and_temperature(beta, temperature):
    run_jsd(logits(dtype=torch.bfloat16), logits(), labels(ignored=(2,)), grad_scale_of("0-d"), beta=beta,
            temperature=temperature)


def test_jsd_identical_distributions_are_zero():
    x = logits()
    for beta in (0.0, 0.5, 1.0):
        student = x.clone()
        with jsd.LAUNCH.using(block_size=BLOCK):
            loss = jsd_loss_and_grad(student, x, None, beta=beta, temperature=2.0)
        torch.testing.assert_close(loss, torch.zeros_like(loss), atol=1e-6, rtol=0)
        torch.testing.assert_close(student, torch.zeros_like(student), atol=1e-7, rtol=0)


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16])
def test_kl_zero_probabilities(log_target, target_dtype):
    target = probabilities(dtype=target_dtype)
    if log_target:
        target = target.float().log().to(target_dtype)  # -inf where the probability is 0
    run_kl(logits(dtype=torch.bfloat16), target, labels(ignored=(4,)), grad_scale_of("per-row"),
           temperature=2.0, log_target=log_target)


@pytest.mark.parametrize("reads", [1, 2])
@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mass", [1.0, 0.7])
def test_kl_target_read_once_or_twice(reads, target_dtype, mass):
    """Both variants on both target dtypes; a target summing to 0.7 takes the single-read variant's fix-up pass."""
    with kl_div.LAUNCH.using(target_reads=reads):
        run_kl(logits(dtype=torch.bfloat16), (probabilities() * mass).to(target_dtype), labels(ignored=(2,)),
               grad_scale_of("per-row"), temperature=1.5)


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_kl_unnormalized_log_target_read_once(logits_dtype):
    target = (probabilities() * 1.25).log()  # sums to 1.25; -inf where the probability is 0
    with kl_div.LAUNCH.using(target_reads=1):
        run_kl(logits(dtype=logits_dtype), target, None, grad_scale_of("0-d"), log_target=True)


def test_kl_variant_two_reads_unless_forced():
    """The single read's fix-up is imprecise for rows far from sum 1 (kl_div.py), so it serves only when forced."""
    fp32, bf16 = torch.empty(0, dtype=torch.float32), torch.empty(0, dtype=torch.bfloat16)
    for target in (fp32, bf16):
        for log_target in (False, True):
            assert not kl_div.reads_target_once(target, kl_div.LAUNCH.current, log_target)
    with kl_div.LAUNCH.using(target_reads=1) as knobs:
        assert kl_div.reads_target_once(fp32, knobs)


@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_kl_eps_and_tiny_probabilities(eps):
    target = probabilities()  # zeros in the first 20 columns
    target[:, 20:40] = 1e-30
    run_kl(logits(), target, None, eps=eps)


# ---------------------------------------------------------------- launch configuration and capability


def test_launch_configuration():
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    fp32 = torch.empty(0, dtype=torch.float32)
    assert _support.row_launch(128256, bf16) == dict(BLOCK=8192, NUM_STAGES=_support.NUM_STAGES, num_warps=16)
    assert _support.row_launch(128256, bf16, fp32)["BLOCK"] == 4096  # the widest input sets the block
    assert _support.row_launch(300, bf16) == dict(BLOCK=512, NUM_STAGES=_support.NUM_STAGES, num_warps=1)
    knobs = _support.RowLaunch(block_size=64, num_warps=2, num_stages=1)
    assert _support.row_launch(300, bf16, knobs=knobs) == dict(BLOCK=64, NUM_STAGES=1, num_warps=2)


def test_capability_accepts_cpu_only_under_the_interpreter():
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    assert ("cpu" in _support.CAPABILITY.devices) == interpreting
    assert "cuda" in _support.CAPABILITY.devices


# ---------------------------------------------------------------- GPU: real vocabularies, C * V > 2^31


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [128256, 262208])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_real_vocab(vocab, dtype):
    rows = 16
    target = labels(rows, vocab, ignored=(3,))
    run_ce(logits(rows, vocab, dtype=dtype), target, grad_scale_of("0-d"), block=None, label_smoothing=0.1)
    run_jsd(logits(rows, vocab, dtype=dtype), logits(rows, vocab, dtype=dtype), target, block=None, beta=0.5,
            temperature=2.0)
    run_jsd(logits(rows, vocab, dtype=dtype), logits(rows, vocab, dtype=dtype), target, block=None, beta=0.0)
    run_kl(logits(rows, vocab, dtype=dtype), probabilities(rows, vocab, dtype=dtype), target, block=None)
    for mass in (1.0, 0.8):  # an fp32 target is read once; one summing to 0.8 takes the fix-up pass
        run_kl(logits(rows, vocab, dtype=dtype), probabilities(rows, vocab) * mass, target, block=None, temperature=2.0)


@pytest.mark.gpu
def test_gpu_rows_past_2_pow_31_elements():
    """C * V = 8320 * 262208 > 2^31: the last rows start past the 32-bit offset range."""
    rows, vocab = 8320, 262208
    assert rows * vocab > 2**31
    x = torch.randn(rows, vocab, device=DEVICE, dtype=torch.bfloat16)
    tail = slice(rows - 3, rows)
    target = labels(rows, vocab, ignored=(rows - 2,))
    before = x[tail].clone()
    loss = ce_loss_and_grad(x, target, ignore_index=IGNORE)
    check(loss[tail], x[tail], *reference(lambda z: ce_rows(z, target[tail], ignore_index=IGNORE), before))

    teacher = torch.randn_like(x)
    x[tail] = before
    loss = jsd_loss_and_grad(x, teacher, target, beta=0.5, ignore_index=IGNORE)
    expected = reference(lambda s: jsd_rows(s, teacher[tail], target[tail], beta=0.5, ignore_index=IGNORE), before)
    check(loss[tail], x[tail], *expected)

    x[tail] = before  # the teacher read as log-probabilities (unnormalized: the formula does not need them to be)
    loss = kl_div_loss_and_grad(x, teacher, target, ignore_index=IGNORE, log_target=True)
    expected = reference(
        lambda s: kl_div_rows(s, teacher[tail], target[tail], ignore_index=IGNORE, log_target=True), before)
    check(loss[tail], x[tail], *expected)
