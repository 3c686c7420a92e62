"""Op specs of the mHC coefficient ops (arXiv 2512.24880)."""

from __future__ import annotations

import math

import torch

from liger_dispatch.errors import InputError
from liger_dispatch.mhc import compose_mhc
from liger_dispatch.registry import checks as c
from liger_dispatch.table import TABLE, OpSpec, TensorSpec

def streams_of(phi: torch.Tensor) -> int:
    """HC from phi's column count HC^2 + 2 HC."""
    n = phi.shape[1]
    hc = int(round(math.sqrt(n + 1) - 1))
    if hc < 1 or hc * hc + 2 * hc != n:
        raise InputError(f"phi has {n} columns, which is not HC^2 + 2*HC for any HC")
    return hc


def _params(x_name, x, phi, b, alpha_pre, alpha_post, alpha_res, hc, k):
    c.tensor("phi", phi, ndim=2, floating=True)
    got_hc = streams_of(phi)
    if hc is not None and got_hc != hc:
        raise InputError(f"phi has {phi.shape[1]} columns, which means HC = {got_hc}, but hc is {hc}")
    if phi.shape[0] != k:
        raise InputError(f"phi has {phi.shape[0]} rows but {x_name} has HC*C = {k}; HC*C must match phi")
    c.tensor("b", b, ndim=1)
    if b.dtype != torch.float32 or b.shape[0] != phi.shape[1]:
        raise InputError(f"b must be float32 of length {phi.shape[1]}, got {b.dtype} {tuple(b.shape)}")
    for name, alpha in (("alpha_pre", alpha_pre), ("alpha_post", alpha_post), ("alpha_res", alpha_res)):
        c.tensor(name, alpha)
        if alpha.numel() != 1 or alpha.dtype != torch.float32:
            raise InputError(f"{name} must be a 0-d float32 tensor, got {alpha.dtype} {tuple(alpha.shape)}")
    c.same_device(**{x_name: x}, phi=phi, b=b, alpha_pre=alpha_pre, alpha_post=alpha_post, alpha_res=alpha_res)
    return got_hc


def _options(tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult):
    c.integer("tmax", tmax)
    if tmax < 1:
        raise InputError(f"tmax must be >= 1, got {tmax}")
    c.positive("rms_eps", rms_eps)
    c.non_negative("pre_eps", pre_eps)
    c.non_negative("sinkhorn_eps", sinkhorn_eps)
    c.positive("post_mult", post_mult)


def check_mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, *, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                     sinkhorn_eps=1e-6, post_mult=2.0):
    c.tensor("x", x, min_ndim=2, floating=True)
    hc = _params("x", x, phi, b, alpha_pre, alpha_post, alpha_res, None, x.shape[-2] * x.shape[-1])
    if x.shape[-2] != hc:
        raise InputError(f"x has {x.shape[-2]} streams (dim -2) but phi's {phi.shape[1]} columns mean HC = {hc}")
    _options(tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult)


def check_mhc_coeff_fwd(x, phi, b, alpha_pre, alpha_post, alpha_res, *, hc, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                        sinkhorn_eps=1e-6, post_mult=2.0):
    c.tensor("x", x, ndim=2, floating=True)
    _params("x", x, phi, b, alpha_pre, alpha_post, alpha_res, hc, x.shape[1])
    _options(tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult)


def check_mhc_coeff_bwd(x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd, grad_h_pre, grad_h_post, grad_h_res,
                        *, hc, tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0):
    check_mhc_coeff_fwd(x, phi, b, alpha_pre, alpha_post, alpha_res, hc=hc, tmax=tmax, rms_eps=rms_eps,
                        pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps, post_mult=post_mult)
    m = x.shape[0]
    expected = {"mix": (m, phi.shape[1]), "rstd": (m,), "grad_h_pre": (m, hc), "grad_h_post": (m, hc),
                "grad_h_res": (m, hc, hc)}
    for name, value in (("mix", mix), ("rstd", rstd), ("grad_h_pre", grad_h_pre), ("grad_h_post", grad_h_post),
                        ("grad_h_res", grad_h_res)):
        if value is None and name.startswith("grad"):
            continue
        c.tensor(name, value)
        if tuple(value.shape) != expected[name]:
            raise InputError(f"{name} must have shape {expected[name]}, got {tuple(value.shape)}")


def probe_mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, *, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                     sinkhorn_eps=1e-6, post_mult=2.0):
    hc, channels = x.shape[-2], x.shape[-1]
    rows = TensorSpec((math.prod(x.shape[:-2]), hc * channels), x.dtype)
    return ((rows, phi, b, alpha_pre, alpha_post, alpha_res),
            dict(hc=hc, tmax=tmax, rms_eps=rms_eps, pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps, post_mult=post_mult))


def declare() -> None:
    TABLE.declare_op(OpSpec("mhc_coeff_fwd", "kernel", check_mhc_coeff_fwd,
                            summary="mHC coefficients forward: x @ phi, RMS scaling, sigmoids, Sinkhorn"))
    TABLE.declare_op(OpSpec("mhc_coeff_bwd", "kernel", check_mhc_coeff_bwd,
                            summary="mHC coefficients backward: Sinkhorn/sigmoid epilogue, then the MM/RMS backward"))
    TABLE.declare_op(OpSpec("mhc_coeffs", "user", check_mhc_coeffs, composed_of=("mhc_coeff_fwd", "mhc_coeff_bwd"),
                            compose=compose_mhc, probe=probe_mhc_coeffs,
                            summary="mHC pre/post/residual coefficients, with autograd"))
