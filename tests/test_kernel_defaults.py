"""Every backend's kernel-level ops called through dispatch with only their required arguments: the schema's
documented defaults (no labels, beta 0.5, temperature 1, ignore_index -100, eps 1e-10, tmax 20, ...) hold in
each backend and give the reference formulas' values with those defaults written out.

Driven by the registry like the conformance suite. On the CPU the Triton and Helion kernels run in Triton's
interpreter and CuTeDSL is skipped; `pytest -m gpu` runs every backend, CuTeDSL included."""

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import dispatch
from liger_dispatch.backends.reference import formulas
from kernel_checks import DEVICE, assert_rel_close, reference
from mhc_checks import GRAD_NAMES, REL_TOL, inputs, upstream
from mhc_checks import reference as mhc_reference

ON_GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu] if ON_GPU else []
C, V = (8, 4099) if ON_GPU else (3, 40)
TOL = 1e-4  # fp32: the kernels' fast exp2 / log2 against float64
SCHEMA_DEFAULTS = {
    "ce_loss_and_grad": dict(ignore_index=-100, label_smoothing=0.0, softcap=None, lse_square_scale=0.0),
    "jsd_loss_and_grad": dict(beta=0.5, ignore_index=-100, temperature=1.0),
    "kl_div_loss_and_grad": dict(ignore_index=-100, temperature=1.0, eps=1e-10, log_target=False),
    "mhc": dict(tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0),
}


def backends(*ops):
    """(op, backend) of every registration, skipped with its reason where the backend cannot serve fp32 here."""
    params = []
    for op in ops:
        status = dispatch.backend_status(op, DEVICE, torch.float32)
        for backend in ld.registered_backends(op):
            why = status.get(backend)
            params.append(pytest.param(op, backend, marks=() if why is None else (pytest.mark.skip(reason=why),),
                                       id=f"{op}-{backend}"))
    return params


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("LIGER_STRICT", "1")  # a pinned backend that silently fell back would test nothing


def loss_case(op):
    """(the second input, the per-row formula with the schema's defaults as a function of the logits)."""
    defaults = SCHEMA_DEFAULTS[op]
    if op == "ce_loss_and_grad":
        target = torch.randint(0, V, (C,), device=DEVICE)
        return target, lambda z: formulas.ce_rows(z, target, **defaults)
    if op == "jsd_loss_and_grad":
        teacher = torch.randn(C, V, device=DEVICE) * 2.0
        return teacher, lambda z: formulas.jsd_rows(z, teacher, None, **defaults)
    probs = torch.softmax(torch.randn(C, V, device=DEVICE) * 2.0, dim=-1)
    return probs, lambda z: formulas.kl_div_rows(z, probs, None, **defaults)


@pytest.mark.parametrize("op,backend", backends("ce_loss_and_grad", "jsd_loss_and_grad", "kl_div_loss_and_grad"))
def test_loss_kernel_with_required_arguments_only(op, backend):
    logits = torch.randn(C, V, device=DEVICE) * 3.0
    other, rows_fn = loss_case(op)
    want_loss, want_grad = reference(rows_fn, logits)
    loss = dispatch.op(op, backend=backend)(logits, other)
    assert_rel_close("loss", loss, want_loss, TOL)
    assert_rel_close("gradient written over the logits", logits, want_grad, TOL)


@pytest.mark.parametrize("fwd,backend", backends("mhc_coeff_fwd"))
def test_mhc_kernels_with_required_arguments_only(fwd, backend):
    hc = 2  # the conformance suite's tmax = 20 shape: the same compiled kernels
    args, grads = inputs(5, hc, 8), upstream(5, hc)
    want_outs, want_grads = mhc_reference(args, grads, hc, **SCHEMA_DEFAULTS["mhc"])
    outs = dispatch.op(fwd, backend=backend)(*args, hc=hc)
    got = dispatch.op("mhc_coeff_bwd", backend=backend)(*args, outs[3], outs[4], *grads, hc=hc)
    for name, o, w in zip(("h_pre", "h_post", "h_res", "mix", "rstd"), outs, want_outs):
        assert_rel_close(name, o, w, REL_TOL[torch.float32])
    for name, g, w in zip(GRAD_NAMES, got, want_grads):
        assert_rel_close(name, g, w, REL_TOL[torch.float32])
