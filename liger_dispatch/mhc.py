"""mhc_coeffs composed from a backend's mhc_coeff_fwd / mhc_coeff_bwd, with autograd."""

from __future__ import annotations

from typing import Callable

import torch


class _MHCCoeffs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, phi, b, alpha_pre, alpha_post, alpha_res, fwd, bwd, options):
        h_pre, h_post, h_res, mix, rstd = fwd(x, phi, b, alpha_pre, alpha_post, alpha_res, **options)
        ctx.save_for_backward(x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd)
        ctx.bwd, ctx.options = bwd, options
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        return h_pre, h_post, h_res

    @staticmethod
    def backward(ctx, grad_pre, grad_post, grad_res):
        grads = ctx.bwd(*ctx.saved_tensors, grad_pre, grad_post, grad_res, **ctx.options)
        return (*grads, None, None, None)


def compose_mhc(fwd: Callable, bwd: Callable) -> Callable:
    def mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, *, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                   sinkhorn_eps=1e-6, post_mult=2.0):
        hc = x.shape[-2]
        lead = x.shape[:-2]
        x2 = x.reshape(-1, hc * x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        options = dict(hc=hc, tmax=tmax, rms_eps=rms_eps, pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps,
                       post_mult=post_mult)
        h_pre, h_post, h_res = _MHCCoeffs.apply(x2, phi, b, alpha_pre, alpha_post, alpha_res, fwd, bwd, options)
        return h_pre.view(*lead, hc), h_post.view(*lead, hc), h_res.view(*lead, hc, hc)

    return mhc_coeffs
