"""Inputs and the float64 check the per-backend mHC kernel tests share."""

import torch

from kernel_checks import assert_rel_close
from liger_dispatch.backends.reference.formulas import mhc_coeffs_from_mix, mhc_mix

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPTIONS = dict(rms_eps=1e-6, pre_eps=0.01, sinkhorn_eps=1e-6, post_mult=2.0)
GRAD_NAMES = ("grad_x", "grad_phi", "grad_b", "grad_alpha_pre", "grad_alpha_post", "grad_alpha_res")
# relative Frobenius error: fp32 math throughout (the alpha grads are sums that cancel); for 16-bit inputs the
# backward's grad_mix * rstd is rounded to the dtype for the tensor-core dots, and grad_x / grad_phi are stored in it
REL_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def inputs(m, hc, c, dtype=torch.float32, x_row_stride=None, phi_dtype=None):
    """x [m, hc*c] (a view into a wider buffer when x_row_stride is given), phi, b and the three alphas."""
    k, n = hc * c, hc * hc + 2 * hc
    x = torch.randn(m, x_row_stride or k, device=DEVICE).to(dtype)[:, :k]
    phi = (torch.randn(k, n, device=DEVICE) * k ** -0.5).to(phi_dtype or dtype)
    b = torch.randn(n, device=DEVICE) * 0.5
    alphas = [torch.tensor(v, device=DEVICE) for v in (0.8, 1.3, 0.9)]
    return x, phi, b, *alphas


def upstream(m, hc, present=(True, True, True)):
    shapes = ((m, hc), (m, hc), (m, hc, hc))
    return [torch.randn(s, device=DEVICE) if p else None for s, p in zip(shapes, present)]


def reference(args, grads, hc, **options):
    """Float64 forward outputs (h_pre, h_post, h_res, mix, rstd) and the six gradients through autograd, of the
    formulas with these options (the formulas' own defaults where absent)."""
    leaves = [t.detach().double().requires_grad_() for t in args]
    mix_options = {"rms_eps": options.pop("rms_eps")} if "rms_eps" in options else {}
    mix, rstd = mhc_mix(leaves[0], leaves[1], **mix_options)
    coeffs = mhc_coeffs_from_mix(mix, *leaves[2:], hc=hc, **options)
    pairs = [(h, g.double()) for h, g in zip(coeffs, grads) if g is not None]
    if pairs:
        outs, gs = zip(*pairs)
        expected = torch.autograd.grad(outs, leaves, gs, allow_unused=True)
        expected = [torch.zeros_like(t) if g is None else g for g, t in zip(expected, leaves)]
    else:
        expected = [torch.zeros_like(t) for t in leaves]
    return [t.detach() for t in (*coeffs, mix, rstd)], expected


# upstream gradients present (h_pre, h_post, h_res): the cases where some are None
MISSING_GRADS = [(False, True, True), (True, False, False), (False, False, True), (False, False, False)]
MISSING_GRADS_IDS = ["no-pre", "pre-only", "res-only", "none"]


def check_mhc(mhc, m, hc, c, tmax, dtype=torch.float32, present=(True, True, True), x_row_stride=None,
              phi_dtype=None, rel_tol=None, grads=None, deterministic=False):
    """Runs a backend's mhc_coeff_fwd / mhc_coeff_bwd (module `mhc`) on fresh inputs and checks all outputs
    (gradients to rel_tol, by default REL_TOL of the dtype). grads: the upstream gradients (default: fresh ones
    as `present` says). deterministic: the backward, run again, gives the same bits."""
    args = inputs(m, hc, c, dtype, x_row_stride, phi_dtype)
    grads = upstream(m, hc, present) if grads is None else grads
    outs = mhc.mhc_coeff_fwd(*args, hc=hc, tmax=tmax, **OPTIONS)
    got = mhc.mhc_coeff_bwd(*args, outs[3], outs[4], *grads, hc=hc, tmax=tmax, **OPTIONS)
    want_outs, want_grads = reference(args, grads, hc, tmax=tmax, **OPTIONS)

    for name, o, w in zip(("h_pre", "h_post", "h_res", "mix", "rstd"), outs, want_outs):
        assert o.dtype == torch.float32 and o.shape == w.shape, name
        torch.testing.assert_close(o.double(), w, rtol=1e-4, atol=1e-4, msg=name)  # fp32 sums over K
    for name, g, w, a in zip(GRAD_NAMES, got, want_grads, args):
        assert g.dtype == (a.dtype if name in ("grad_x", "grad_phi") else torch.float32), name
        assert g.shape == a.shape, name
        assert_rel_close(name, g, w, rel_tol or REL_TOL[dtype])
    if deterministic:
        again = mhc.mhc_coeff_bwd(*args, outs[3], outs[4], *grads, hc=hc, tmax=tmax, **OPTIONS)
        for name, a, b in zip(GRAD_NAMES, got, again):
            assert torch.equal(a, b), f"{name} differs between two runs"
    return args, grads, outs, got


def check_empty_batch(mhc):
    """No rows: outputs of the right shapes, zero parameter gradients."""
    args = inputs(0, 4, 8)
    outs = mhc.mhc_coeff_fwd(*args, hc=4, tmax=3)
    assert [tuple(o.shape) for o in outs] == [(0, 4), (0, 4), (0, 4, 4), (0, 24), (0,)]
    got = mhc.mhc_coeff_bwd(*args, outs[3], outs[4], *upstream(0, 4), hc=4, tmax=3)
    assert got[0].shape == (0, 32) and not got[1].any() and not got[2].any()
