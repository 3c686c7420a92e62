"""mhc_coeffs composed from a backend's mhc_coeff_fwd / mhc_coeff_bwd, with autograd."""

from __future__ import annotations

from typing import Callable

import torch


def _shaped(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A fresh [M, ...] output given the caller's leading dims without becoming a view: autograd forbids
    in-place changes to a view made inside a custom Function, and views outside it would each add a node
    to every backward."""
    if t._base is None and t.is_contiguous():
        return t.resize_(shape)  # same element count: only the sizes change
    return t.reshape(shape).clone()


class _MHCCoeffs(torch.autograd.Function):
    """x [..., HC, C] -> (h_pre [..., HC], h_post [..., HC], h_res [..., HC, HC]); one graph node."""

    @staticmethod
    def forward(ctx, x, phi, b, alpha_pre, alpha_post, alpha_res, kernels):
        fwd, _, options = kernels
        *lead, hc, channels = x.shape
        x2 = x.reshape(-1, hc * channels)  # a view of a residual-stream x
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        h_pre, h_post, h_res, mix, rstd = fwd(x2, phi, b, alpha_pre, alpha_post, alpha_res, **options)
        ctx.save_for_backward(x2, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd)
        ctx.kernels, ctx.x_shape = kernels, x.shape
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return _shaped(h_pre, (*lead, hc)), _shaped(h_post, (*lead, hc)), _shaped(h_res, (*lead, hc, hc))

    @staticmethod
    def backward(ctx, grad_pre, grad_post, grad_res):
        _, bwd, options = ctx.kernels
        saved = ctx.saved_tensors
        m, hc = saved[0].shape[0], options["hc"]
        grad_x, *grads = bwd(*saved, None if grad_pre is None else grad_pre.reshape(m, hc),
                             None if grad_post is None else grad_post.reshape(m, hc),
                             None if grad_res is None else grad_res.reshape(m, hc, hc), **options)
        return grad_x.view(ctx.x_shape), *grads, None


def compose_mhc(fwd: Callable, bwd: Callable) -> Callable:
    def mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, *, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                   sinkhorn_eps=1e-6, post_mult=2.0):
        options = dict(hc=x.shape[-2], tmax=tmax, rms_eps=rms_eps, pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps,
                       post_mult=post_mult)
        return _MHCCoeffs.apply(x, phi, b, alpha_pre, alpha_post, alpha_res, (fwd, bwd, options))

    return mhc_coeffs
