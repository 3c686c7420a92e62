"""The Helion vocab-parallel kernels (issue 11): statistics per slice, combined, then the gradient pass per slice,
against the reference formulas on the whole vocabulary (tests/vp_checks.py), on one rank, uneven slices and an
empty one, with blocks of 16 columns (several a row, a ragged last one) and one or two rows a program.

On the CPU they run under TRITON_INTERPRET=1 on tiny shapes, like tests/test_helion_kernels.py.
"""

import contextlib
import inspect

import pytest
import torch

from liger_dispatch.backends.helion import vocab_parallel as vp
from liger_dispatch.backends.reference.formulas import ce_rows, jsd_rows, kl_div_rows
from liger_dispatch.table import TABLE

from kernel_checks import DEVICE, IGNORE, check, check_rows_relative, inputs, reference
from vp_checks import OPS, SPLITS, UNEVEN, WITH_EMPTY, check_empty_slice, run_ce, run_jsd, run_kl_div, uneven

C, V = 5, 37
logits, labels = inputs(C, V)
KERNELS = (vp.CE_STATS, vp.CE_GRAD, vp.JSD_STATS, vp.JSD_SUMS, vp.JSD_GRAD, vp.KL_DIV_STATS, vp.KL_DIV_GRAD)


@contextlib.contextmanager
def blocks_of_16(rows_per_program=1):
    """Every vocab-parallel kernel on blocks of 16 columns (3 a row of 37, the last of 5)."""
    config = {"block_sizes": [rows_per_program, 16], "num_warps": 1, "num_stages": 1}
    with contextlib.ExitStack() as stack:
        for kernel in KERNELS:
            stack.enter_context(kernel.using(config))
        yield


CE_CASES = {
    "one-rank": (SPLITS["one-rank"], {}, None, 1),
    "uneven, every option": (UNEVEN, dict(label_smoothing=0.1, softcap=5.0, lse_square_scale=1e-2), "per-row", 1),
    "empty slice, two rows a program": (WITH_EMPTY, dict(label_smoothing=0.2), "0-d", 2),
}


@pytest.mark.parametrize("case", CE_CASES)
def test_ce_slices_combine_to_the_whole_vocabulary(case):
    bounds, options, scale, rows_per_program = CE_CASES[case]
    x = logits(scale=8.0)
    target = labels(ignored=(0, 3))
    grad_scale = {None: None, "per-row": torch.rand(C, device=DEVICE) + 0.1, "0-d": torch.tensor(0.3)}[scale]
    expected = reference(lambda z: ce_rows(z, target, ignore_index=IGNORE, **options), x, grad_scale)
    with blocks_of_16(rows_per_program):
        loss = run_ce(vp, x, target, bounds, grad_scale=grad_scale, **options)
    check(loss, x, *expected)
    assert (x[[0, 3]] == 0).all()


def test_ce_targets_in_every_slice_and_bf16_logits():
    x = logits(dtype=torch.bfloat16)
    target = torch.tensor([0, 9, 10, 32, 36], device=DEVICE)  # the first and last column of each slice
    expected = reference(lambda z: ce_rows(z, target, ignore_index=IGNORE), x)
    with blocks_of_16():
        loss = run_ce(vp, x, target, UNEVEN)
    check(loss, x, *expected)


@pytest.mark.parametrize("beta, split", [(0.0, "uneven"), (1.0, "with-empty"), (0.4, "uneven"), (0.5, "one-rank")])
def test_jsd_slices_combine_to_the_whole_vocabulary(beta, split):
    student = logits()
    teacher = logits(scale=3.0)
    teacher_before = teacher.clone()
    lab = None if split == "one-rank" else labels()
    grad_scale = torch.rand(C, device=DEVICE)
    options = dict(beta=beta, temperature=1.7)
    expected = reference(lambda s: jsd_rows(s, teacher, lab, ignore_index=IGNORE, **options), student, grad_scale)
    with blocks_of_16():
        loss = run_jsd(vp, student, teacher, lab, SPLITS[split], grad_scale=grad_scale, **options)
    check(loss, student, *expected)
    assert torch.equal(teacher, teacher_before)


@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_slices_combine_to_the_whole_vocabulary(log_target):
    student = logits()
    probs = torch.softmax(torch.randn(C, V, device=DEVICE) * 2, dim=-1)
    probs[0, :12] = 0.0  # 0 log 0 = 0 (a log-target of -inf), across a slice boundary
    target = probs.log() if log_target else probs
    target_before = target.clone()
    lab = labels()
    options = dict(temperature=0.8, log_target=log_target)
    expected = reference(lambda s: kl_div_rows(s, target, lab, ignore_index=IGNORE, **options), student,
                         torch.tensor(0.5))
    with blocks_of_16():
        loss = run_kl_div(vp, student, target, lab, UNEVEN, grad_scale=torch.tensor(0.5), **options)
    check(loss, student, *expected)
    assert torch.equal(target, target_before)


def test_all_rows_ignored_give_zero_statistics_and_gradient():
    x = logits()
    target = labels(ignored=range(C))
    with blocks_of_16():
        stats = vp.ce_vp_stats(x, target, vocab_start=3)
        vp.ce_vp_grad(x, target, torch.full((C,), float("-inf")), vocab_size=50, label_smoothing=0.1)
    assert (stats == 0).all() and (x == 0).all()


def test_empty_slices_launch_nothing():
    check_empty_slice(vp, DEVICE)


def test_registered_for_every_op_with_its_signature_and_the_backend_capability():
    for op in OPS:
        (impl,) = [i for i in TABLE.candidates(op) if i.backend == "helion"]
        assert impl.fn is getattr(vp, op) and impl.capability == vp.CAPABILITY
        assert inspect.signature(impl.fn) == inspect.signature(TABLE.spec(op).check), op


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256, 262208])
def test_gpu_real_vocabularies_over_uneven_slices(vocab):
    rows = 256
    bounds = uneven(vocab)
    target = labels(rows, vocab, ignored=range(0, rows, 5))
    teacher = logits(rows, vocab, torch.bfloat16)
    probs = torch.softmax(torch.randn(rows, vocab, device=DEVICE) * 2, dim=-1)
    cases = [
        (lambda z: ce_rows(z, target, ignore_index=IGNORE, label_smoothing=0.1),
         lambda z: run_ce(vp, z, target, bounds, label_smoothing=0.1)),
        (lambda s: jsd_rows(s, teacher, target, beta=0.5, ignore_index=IGNORE),
         lambda s: run_jsd(vp, s, teacher, target, bounds, beta=0.5)),
        (lambda s: kl_div_rows(s, probs, target, ignore_index=IGNORE),
         lambda s: run_kl_div(vp, s, probs, target, bounds)),
    ]
    for rows_fn, run in cases:
        x = logits(rows, vocab, torch.bfloat16)
        expected = reference(rows_fn, x)
        check_rows_relative(run(x), x, *expected)
