"""Inputs and checks the per-backend loss-kernel tests share: random rows, float64 autograd truth, tolerances."""

import torch

from liger_dispatch.registry.cross_entropy import FLCE_OPTIONS as FLCE_CASES  # noqa: F401 (one source)
from liger_dispatch.testing import assert_rel_close, rel_err  # noqa: F401 (one source)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100
# gradient tolerances: fp32 math on logits up to ~30 (exp amplifies their rounding), then one rounding to the dtype
GRAD_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-4), torch.float16: (2e-3, 1e-5)}


def inputs(default_rows, default_vocab):
    """Makers of random logits and labels whose shape defaults to [default_rows, default_vocab]."""

    def logits(rows=default_rows, vocab=default_vocab, dtype=torch.float32, scale=4.0, row_stride=None):
        """Random logits; with row_stride > vocab, a view into a wider buffer whose padding holds a sentinel."""
        buffer = torch.full((rows, row_stride or vocab), 7.0, dtype=dtype, device=DEVICE)
        view = buffer[:, :vocab]
        view.copy_(torch.randn(rows, vocab, device=DEVICE) * scale)
        return view

    def labels(rows=default_rows, vocab=default_vocab, ignored=(1,)):
        out = torch.randint(0, vocab, (rows,), device=DEVICE)
        out[list(ignored)] = IGNORE
        return out

    return logits, labels


GRAD_SCALE_FORMS = ("none", "0-d", "per-row", "expanded", "strided")


def grad_scale(form, rows, device=DEVICE):
    """A grad_scale in one of the forms the loss kernels take: None, 0-d, [rows], an expanded 0-d view, a strided
    [rows] view."""
    return {
        "none": lambda: None,
        "0-d": lambda: torch.tensor(0.37, device=device),
        "per-row": lambda: torch.rand(rows, device=device) + 0.1,
        "expanded": lambda: torch.tensor(0.5, device=device).expand(rows),
        "strided": lambda: torch.rand(2 * rows, device=device)[::2] + 0.1,
    }[form]()


def reference(rows_fn, x, grad_scale=None):
    """float64 per-row loss and grad_scale * d loss_i / d x_i of the spec's formulas."""
    x64 = x.detach().double().requires_grad_()
    rows = rows_fn(x64)
    scale = torch.ones_like(rows) if grad_scale is None else grad_scale.double().expand_as(rows)
    (grad,) = torch.autograd.grad(rows, x64, scale)
    return rows.detach(), grad


def check(loss, grad, expected_loss, expected_grad):
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-5, atol=2e-5)
    rtol, atol = GRAD_TOL[grad.dtype]
    torch.testing.assert_close(grad.double(), expected_grad, rtol=rtol, atol=atol)


def check_rows_relative(loss, grad, expected_loss, expected_grad, tol=5e-3):
    """Real vocabularies: softmax entries near 1/V sit far below any useful atol, so compare each row's
    gradient by its relative norm (bf16 rounding alone gives ~2e-3)."""
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-4, atol=1e-4)
    err = (grad.double() - expected_grad).norm(dim=1)
    assert (err <= tol * expected_grad.norm(dim=1)).all(), err.max()


def keep_some_slices(monkeypatch, rows, hidden, vocab, dtype, columns, every=False):
    """Set LIGER_CHUNK_COLUMNS and a LIGER_CHUNK_BUDGET_MB under which the vocabulary-chunk layout keeps the logits in
    dW's memory, some slices' (or, `every`, all) from the forward and the others recomputed in the backward
    (compose/vocab_chunks.py)."""
    from liger_dispatch.compose import vocab_chunks

    monkeypatch.setenv("LIGER_CHUNK_COLUMNS", str(columns))
    x, w = (torch.empty(n, hidden, dtype=dtype, device="meta") for n in (rows, vocab))
    nbytes = 16
    while nbytes < 1 << 30:
        monkeypatch.setenv("LIGER_CHUNK_BUDGET_MB", repr(nbytes / 2**20))
        plan = vocab_chunks.layout(x, w)
        kept = len(plan.offsets)
        if plan.grad_bytes and (kept == len(plan.slices) if every else 0 < kept < len(plan.slices)):
            return plan
        nbytes += max(8, nbytes // 64)
    raise AssertionError(f"no budget keeps {'all' if every else 'only some'} of the {columns}-column slices of "
                         f"[{rows}, {vocab}] in dW's memory")
