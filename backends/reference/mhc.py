"""Reference mhc_coeff_fwd / mhc_coeff_bwd: formulas.py forward, backward by recomputation through autograd."""

import torch

from liger_dispatch import register_backend

from ._support import CAPABILITY, PRIORITY, autograd_on
from .formulas import compute_dtype, mhc_coeffs_from_mix, mhc_mix


@register_backend("mhc_coeff_fwd", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def mhc_coeff_fwd(x, phi, b, alpha_pre, alpha_post, alpha_res, *, hc, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                  sinkhorn_eps=1e-6, post_mult=2.0):
    """x [M, K] -> (h_pre [M, hc], h_post [M, hc], h_res [M, hc, hc], mix [M, n], rstd [M]), fp32."""
    with torch.no_grad():
        mix, rstd = mhc_mix(x, phi, rms_eps=rms_eps)
        coeffs = mhc_coeffs_from_mix(mix, b, alpha_pre, alpha_post, alpha_res, hc=hc, tmax=tmax, pre_eps=pre_eps,
                                     sinkhorn_eps=sinkhorn_eps, post_mult=post_mult)
    return (*coeffs, mix, rstd)


@register_backend("mhc_coeff_bwd", backend="reference", priority=PRIORITY, capability=CAPABILITY)
def mhc_coeff_bwd(x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd, grad_h_pre, grad_h_post, grad_h_res, *,
                  hc, tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0):
    """-> (grad_x in x.dtype, grad_phi in phi.dtype, grad_b, grad_alpha_pre, grad_alpha_post, grad_alpha_res).

    The saved mix and rstd are not used: everything is recomputed from x and phi.
    """
    originals = (x, phi, b, alpha_pre, alpha_post, alpha_res)
    dtype = compute_dtype(x, phi)
    x_, phi_ = (t.detach().to(dtype, copy=True).requires_grad_() for t in (x, phi))
    params = [t.detach().clone().requires_grad_() for t in originals[2:]]
    inputs = [x_, phi_, *params]
    with autograd_on():
        recomputed_mix, _ = mhc_mix(x_, phi_, rms_eps=rms_eps)
        coeffs = mhc_coeffs_from_mix(recomputed_mix, *params, hc=hc, tmax=tmax, pre_eps=pre_eps,
                                     sinkhorn_eps=sinkhorn_eps, post_mult=post_mult)
        pairs = [(h, g.to(h.dtype)) for h, g in zip(coeffs, (grad_h_pre, grad_h_post, grad_h_res)) if g is not None]
        grads = [None] * len(inputs)
        if pairs:
            outputs, grad_outputs = zip(*pairs)
            grads = torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(grads, originals))
