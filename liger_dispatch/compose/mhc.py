"""mhc_coeffs composed from a backend's mhc_coeff_fwd / mhc_coeff_bwd.

The composition is an `MHCCoeffs` object: calling it runs the forward on rows of K = HC * C and returns the three
coefficients in the caller's leading dims plus what the backward needs (mix, rstd); `backward` runs the kernel-level
backward. Autograd around it lives in liger_dispatch/core/torch_ops.py (eager and traced).
"""

from __future__ import annotations

from typing import Callable

import torch


class MHCCoeffs:
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
                 tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult):
        """-> (grad_x [..., HC, C], grad_phi, grad_b, grad_alpha_pre, grad_alpha_post, grad_alpha_res)."""
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


def compose_mhc(fwd: Callable, bwd: Callable) -> MHCCoeffs:
    return MHCCoeffs(fwd, bwd)
