"""The conformance suite, driven by the registry: every (op, backend) that can run here is compared with
the reference formulas on fresh random inputs. A new backend is tested by registering it.

The cases live in the op family modules of registry/ (CASES; liger_dispatch.testing.CASES has them all), the same
ones `python -m liger_dispatch verify --backend NAME` runs on a backend outside this repository. On the CPU the
shapes are tiny (Triton and Helion kernels run in Triton's interpreter) and the low-precision dtypes get the smoke
cases; `pytest -m gpu` runs every case at real shapes in every dtype on the GPU."""

from __future__ import annotations

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import testing
from liger_dispatch.testing import inputs_for

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
_SHAPES = testing.shapes(DEVICE)
N, H, V = _SHAPES["N"], _SHAPES["H"], _SHAPES["V"]
pytestmark = [pytest.mark.gpu] if ON_GPU else []  # on a GPU host: `pytest -m gpu` runs this suite at real shapes


def cases(op):
    """(op, backend, dtype, case) for every case of the op, every registered backend, the case's dtypes here;
    skipped, with the reason, where the backend cannot serve that dtype here."""
    params, reasons = [], {}
    for case in testing.CASES[op]:
        for dtype in case.dtypes_on(DEVICE):
            for backend in ld.registered_backends(op):
                key = (backend, dtype)
                if key not in reasons:
                    reasons[key] = testing.unavailable(op, backend, DEVICE, dtype)
                marks = () if reasons[key] is None else (pytest.mark.skip(reason=reasons[key]),)
                params.append(pytest.param(op, backend, dtype, case.name, marks=marks,
                                           id=testing.case_id(op, backend, dtype, case.name)))
    return params


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("LIGER_STRICT", "1")  # a pinned backend that silently fell back would test nothing


@pytest.mark.parametrize("op,backend,dtype,case", [p for op in testing.CASES for p in cases(op)])
def test_case(op, backend, dtype, case):
    testing.check_case(op, backend, dtype, case, DEVICE)


def test_every_user_level_op_has_cases():
    assert set(testing.CASES) == set(ld.core.table.TABLE.op_names("user"))
    for op, op_cases in testing.CASES.items():
        assert sum(c.sample for c in op_cases) == 1, f"{op}: one sample case"


# -- the shared driver on the reference kernels ----------------------------------------------------------------------
def run_and_compare(op, backend, dtype, inputs, kwargs, grad_names, upstream=0.7):
    for m in testing.compare(op, backend, dtype, inputs, kwargs, grad_names, upstream):
        assert m.ok, f"{op} {m.describe()}"


def randn(*shape, dtype=torch.float32, scale=1.0):
    return inputs_for(DEVICE, dtype).randn(*shape, scale=scale)


def labels(n, vocab, ignored=(), all_ignored=False):
    return inputs_for(DEVICE, torch.float32).labels(n, vocab, ignored, all_ignored)


def kl_target(n, vocab, dtype, log_target, zeros):
    return testing.Inputs(torch.device(DEVICE), dtype, n, H, vocab).kl_target(n, log_target, zeros, dtype)


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


