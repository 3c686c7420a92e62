"""The mHC coefficient ops (manifold-constrained hyper-connections, arXiv 2512.24880): the user-level
`mhc_coeffs` with autograd, and the kernel-level forward and backward it is composed of.

    mhc_coeffs(x [..., HC, C], phi [HC*C, HC^2 + 2 HC], b, alpha_pre, alpha_post, alpha_res)
        -> (h_pre [..., HC], h_post [..., HC], h_res [..., HC, HC]), fp32
    mhc_coeff_fwd(x [M, HC*C], ...) -> (h_pre, h_post, h_res, mix [M, n], rstd [M])
    mhc_coeff_bwd(x, ..., mix, rstd, grad_h_pre?, grad_h_post?, grad_h_res?) -> gradients of x, phi, b and the alphas
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks as c
from liger_dispatch.core.table import OpSpec, TensorSpec
from liger_dispatch.registry.cases import FP16, Case, Inputs, empty_leaves
from liger_dispatch.tuning import points as tp


def streams_of(phi: torch.Tensor) -> int:
    """HC from phi's column count HC^2 + 2 HC."""
    n = phi.shape[1]
    hc = int(round(math.sqrt(n + 1) - 1))
    if hc < 1 or hc * hc + 2 * hc != n:
        raise InputError(f"phi has {n} columns, which is not HC^2 + 2*HC for any HC")
    return hc


def _params(x_name, a, hc, k):
    x, phi, b = a.x, a.phi, a.b
    alpha_pre, alpha_post, alpha_res = a.alpha_pre, a.alpha_post, a.alpha_res
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


def _options(a):
    c.integer("tmax", a.tmax)
    if a.tmax < 1:
        raise InputError(f"tmax must be >= 1, got {a.tmax}")
    c.positive("rms_eps", a.rms_eps)
    c.non_negative("pre_eps", a.pre_eps)
    c.non_negative("sinkhorn_eps", a.sinkhorn_eps)
    c.positive("post_mult", a.post_mult)


def check_mhc_coeffs(a):
    c.tensor("x", a.x, min_ndim=2, floating=True)
    if a.x.shape[-1] == 0:
        raise InputError(f"x has shape {tuple(a.x.shape)}: its channel count C (last dim) is 0")
    hc = _params("x", a, None, a.x.shape[-2] * a.x.shape[-1])
    if a.x.shape[-2] != hc:
        raise InputError(f"x has {a.x.shape[-2]} streams (dim -2) but phi's {a.phi.shape[1]} columns mean HC = {hc}")
    _options(a)


def check_mhc_coeff_fwd(a):
    c.tensor("x", a.x, ndim=2, floating=True)
    if a.x.shape[1] == 0:
        raise InputError(f"x has shape {tuple(a.x.shape)}: its row length HC*C (dim 1) is 0")
    _params("x", a, a.hc, a.x.shape[1])
    _options(a)


def check_mhc_coeff_bwd(a):
    check_mhc_coeff_fwd(a)
    m, hc = a.x.shape[0], a.hc
    expected = {"mix": (m, a.phi.shape[1]), "rstd": (m,), "grad_h_pre": (m, hc), "grad_h_post": (m, hc),
                "grad_h_res": (m, hc, hc)}
    for name, shape in expected.items():
        value = getattr(a, name)
        if value is None and name.startswith("grad"):
            continue
        c.tensor(name, value)
        if tuple(value.shape) != shape:
            raise InputError(f"{name} must have shape {shape}, got {tuple(value.shape)}")


def probe_mhc_coeffs(a):
    hc, channels = a.x.shape[-2], a.x.shape[-1]
    rows = TensorSpec((math.prod(a.x.shape[:-2]), hc * channels), a.x.dtype)
    return ((rows, a.phi, a.b, a.alpha_pre, a.alpha_post, a.alpha_res),
            dict(hc=hc, tmax=a.tmax, rms_eps=a.rms_eps, pre_eps=a.pre_eps, sinkhorn_eps=a.sinkhorn_eps,
                 post_mult=a.post_mult))


def _fp32(like, *shape):
    """fp32, float64 for a float64 `like` (as the reference computes)."""
    return like.new_empty(shape, dtype=torch.float64 if like.dtype == torch.float64 else torch.float32)


def fake_mhc_coeff_fwd(a):
    m, hc, n = a.x.shape[0], a.hc, a.phi.shape[1]
    return _fp32(a.x, m, hc), _fp32(a.x, m, hc), _fp32(a.x, m, hc, hc), _fp32(a.x, m, n), _fp32(a.x, m)


def fake_mhc_coeff_bwd(a):
    return (torch.empty_like(a.x), torch.empty_like(a.phi), _fp32(a.b, a.phi.shape[1]), _fp32(a.b), _fp32(a.b),
            _fp32(a.b))


def fake_mhc_coeffs(a):
    """The coefficients in x's leading dims, then what the backward needs: mix [M, n] and rstd [M]."""
    *lead, hc, _ = a.x.shape
    m = math.prod(lead)
    return (_fp32(a.x, *lead, hc), _fp32(a.x, *lead, hc), _fp32(a.x, *lead, hc, hc), _fp32(a.x, m, a.phi.shape[1]),
            _fp32(a.x, m))


_PARAMS = "Tensor x, Tensor phi, Tensor b, Tensor alpha_pre, Tensor alpha_post, Tensor alpha_res"
_OPTIONS = "int tmax=20, float rms_eps=1e-6, float pre_eps=0.0, float sinkhorn_eps=1e-6, float post_mult=2.0"
MHC_SCHEMA = f"mhc_coeffs({_PARAMS}, *, {_OPTIONS}) -> (Tensor, Tensor, Tensor)"
FWD_SCHEMA = f"mhc_coeff_fwd({_PARAMS}, *, int hc, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
BWD_SCHEMA = (f"mhc_coeff_bwd({_PARAMS}, Tensor mix, Tensor rstd, Tensor? grad_h_pre, Tensor? grad_h_post, "
              f"Tensor? grad_h_res, *, int hc, {_OPTIONS}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


class MHCCoeffs:
    """mhc_coeffs composed from a backend's mhc_coeff_fwd / mhc_coeff_bwd: calling it runs the forward on rows of
    K = HC * C and returns the three coefficients in the caller's leading dims plus what the backward needs (mix,
    rstd); `backward` runs the kernel-level backward. Autograd around it is the machinery's (core/torch_ops.py)."""

    def __init__(self, fwd: Callable, bwd: Callable):
        self.fwd, self.bwd = fwd, bwd

    def __call__(self, x, phi, b, alpha_pre, alpha_post, alpha_res, *, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                 sinkhorn_eps=1e-6, post_mult=2.0):
        """-> (h_pre [..., HC], h_post [..., HC], h_res [..., HC, HC], mix [M, n], rstd [M]), all fp32."""
        *lead, hc, channels = x.shape
        rows = _rows(x)
        h_pre, h_post, h_res, mix, rstd = self.fwd(rows, phi, b, alpha_pre, alpha_post, alpha_res, hc=hc, tmax=tmax,
                                                   rms_eps=rms_eps, pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps,
                                                   post_mult=post_mult)
        return _shaped(h_pre, (*lead, hc)), _shaped(h_post, (*lead, hc)), _shaped(h_res, (*lead, hc, hc)), mix, rstd

    def backward(self, x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd, grad_pre, grad_post, grad_res, *,
                 need_grads, tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult):
        """-> (grad_x [..., HC, C], grad_phi, grad_b, grad_alpha_pre, grad_alpha_post, grad_alpha_res): all six
        whatever need_grads says, as the backward kernel makes them in one pass (the small ones are a byproduct of
        grad_x's)."""
        m, hc = mix.shape[0], x.shape[-2]
        grad_x, *grads = self.bwd(
            _rows(x), phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd,
            None if grad_pre is None else grad_pre.reshape(m, hc),
            None if grad_post is None else grad_post.reshape(m, hc),
            None if grad_res is None else grad_res.reshape(m, hc, hc),
            hc=hc, tmax=tmax, rms_eps=rms_eps, pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps, post_mult=post_mult)
        return grad_x.view_as(x), *grads  # view(torch.Size) takes a slower path (~3 us), view(tuple) ~1 us more


def _shaped(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A fresh output given the caller's leading dims without becoming a view (autograd forbids in-place changes
    to a view made inside a custom Function, and each view outside one adds a node to every backward)."""
    if t._base is None and t.is_contiguous():
        return t.resize_(shape)  # same element count: only the sizes change
    return t.reshape(shape).clone()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., HC, C] as rows [M, HC * C]: a view of a residual-stream x when its layout allows."""
    rows = x.reshape(-1, x.shape[-2] * x.shape[-1])
    return rows if rows.is_contiguous() else rows.contiguous()


# ---------------------------------------------------------------- tuning


def bucket(x, *_args, **_):
    return tp.pow2_ceil(tp.rows(x, 2)), (("hc", x.shape[-2]), ("c", tp.pow2_ceil(x.shape[-1])))


def _shape(text: str) -> tuple[int, int, int, int]:
    b, t, hc, channels = (int(v) for v in text.lower().split("x"))
    return b, t, hc, channels


def tune_groups(args, dtype):
    """One point a --mhc shape, with random upstream gradients on the three outputs."""
    for b, t, hc, channels in args.mhc:
        yield lambda device, b=b, t=t, hc=hc, channels=channels: iter([_tune_point(b, t, hc, channels, dtype, device)])


def _tune_point(b, t, hc, channels, dtype, device):
    k, m = hc * channels, hc * hc + 2 * hc
    leaves = [tp.randn((b, t, hc, channels), dtype, device), tp.randn((k, m), dtype, device, k ** -0.5),
              tp.randn((m,), torch.float32, device, 0.1), *(0.5 + torch.rand((), device=device) for _ in range(3))]
    for leaf in leaves:
        leaf.requires_grad_()
    upstream = (torch.randn(b, t, hc, device=device), torch.randn(b, t, hc, device=device),
                torch.randn(b, t, hc, hc, device=device))
    return tp.Point("mhc_coeffs", f"B={b} T={t} HC={hc} C={channels}", tp.Inputs(tuple(leaves), {}, leaves, upstream))


TUNE_ARGUMENTS = ((("--mhc",), dict(nargs="+", type=_shape, default=[(4, 512, 4, 1024), (4, 2048, 4, 4096)],
                                    metavar="BxTxHCxC", help="mhc_coeffs shapes (default: 4x512x4x1024 4x2048x4x4096)")),)

DIFFERENTIABLE = ("x", "phi", "b", "alpha_pre", "alpha_post", "alpha_res")

OPS = (
    OpSpec(FWD_SCHEMA, "kernel", check_mhc_coeff_fwd, fake=fake_mhc_coeff_fwd,
           summary="mHC coefficients forward: x @ phi, RMS scaling, sigmoids, Sinkhorn"),
    OpSpec(BWD_SCHEMA, "kernel", check_mhc_coeff_bwd, fake=fake_mhc_coeff_bwd,
           summary="mHC coefficients backward: Sinkhorn/sigmoid epilogue, then the MM/RMS backward"),
    OpSpec(MHC_SCHEMA, "user", check_mhc_coeffs, composed_of=("mhc_coeff_fwd", "mhc_coeff_bwd"), compose=MHCCoeffs,
           probe=probe_mhc_coeffs, differentiable=DIFFERENTIABLE, fake=fake_mhc_coeffs, saved="Tensor mix, Tensor rstd",
           tuning=tp.Tuning(bucket, tune_groups, TUNE_ARGUMENTS),
           summary="mHC pre/post/residual coefficients, with autograd"),
)
BACKEND_MODULES = {"mhc_coeff_fwd": "mhc", "mhc_coeff_bwd": "mhc"}


# ---------------------------------------------------------------- conformance cases and samples (testing.py)


SHAPES = {True: ((4, 512, 4, 1024), (2048, 4, 256)), False: ((2, 3, 4, 8), (5, 2, 8))}  # by Inputs.real: x's


def _mhc(which, tmax):
    def build(m: Inputs):
        shape = SHAPES[m.real][which]
        hc, c = shape[-2], shape[-1]
        n = hc * hc + 2 * hc
        x = m.randn(*shape)
        if len(shape) == 4:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous
        inputs = dict(x=x, phi=m.randn(hc * c, n, scale=(hc * c) ** -0.5), b=m.randn(n, dtype=torch.float32, scale=0.5),
                      alpha_pre=m.scalar(0.8), alpha_post=m.scalar(1.1), alpha_res=m.scalar(0.9))
        return inputs, dict(tmax=tmax, pre_eps=0.01)
    return build


def _empty(m: Inputs):
    hc, c = SHAPES[m.real][1][-2:]
    n = hc * hc + 2 * hc
    inputs = dict(x=m.randn(0, hc, c), phi=m.randn(hc * c, n), b=m.randn(n, dtype=torch.float32),
                  alpha_pre=m.scalar(0.8), alpha_post=m.scalar(1.1), alpha_res=m.scalar(0.9))
    return empty_leaves(inputs), {}


CASES = {"mhc_coeffs": [
    Case("2x3x4x8-tmax3", _mhc(0, 3), DIFFERENTIABLE, smoke=True, sample=True),
    Case("5x2x8-tmax1", _mhc(1, 1), DIFFERENTIABLE),
    Case("5x2x8-tmax20", _mhc(1, 20), DIFFERENTIABLE),
    Case("empty", _empty, kind="empty", extra_dtypes=FP16),
]}


def _fwd_sample(m: Inputs):
    hc, c = 4, 8
    n = hc * hc + 2 * hc
    rows = m.randn(6, hc * c)
    return (rows, m.randn(hc * c, n, scale=0.1), m.randn(n, dtype=torch.float32), m.scalar(0.5), m.scalar(0.7),
            m.scalar(0.9)), dict(hc=hc, tmax=3)


def _bwd_sample(m: Inputs):
    from liger_dispatch import dispatch

    args, kwargs = _fwd_sample(m)
    *_, mix, rstd = dispatch.op("mhc_coeff_fwd", backend="reference")(*args, **kwargs)
    grads = (m.randn(6, 4, dtype=torch.float32), None, m.randn(6, 4, 4, dtype=torch.float32))
    return (*args, mix, rstd, *grads), kwargs


SAMPLES = {"mhc_coeff_fwd": _fwd_sample, "mhc_coeff_bwd": _bwd_sample}
