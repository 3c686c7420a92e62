"""Host-side pieces the mHC kernel wrappers of every backend share."""

import torch


def columns(hc):
    """n, the columns of phi and mix: hc pre, hc post and hc * hc residual coefficients."""
    return hc * hc + 2 * hc


def cdiv(a, b):
    return -(-a // b)


def forward_outputs(M, hc, device):
    """The outputs of mhc_coeff_fwd, fp32: (h_pre [M, hc], h_post [M, hc], h_res [M, hc, hc], mix [M, n], rstd [M])."""
    n = columns(hc)
    return tuple(torch.empty(*shape, device=device, dtype=torch.float32)
                 for shape in ((M, hc), (M, hc), (M, hc, hc), (M, n), (M,)))


def backward_results(x, phi, n):
    """The outputs of mhc_coeff_bwd: (grad_x, grad_phi, grad_b_alpha, results).

    grad_b_alpha is one fp32 [n + 3] buffer (grad_b, then the three alpha grads) that a kernel fills at once;
    results are the six tensors the op returns, views into it. With no rows, everything but grad_x is zero.
    """
    M, K = x.shape
    grad_x = torch.empty(M, K, device=x.device, dtype=x.dtype)
    grad_phi = torch.empty(K, n, device=x.device, dtype=phi.dtype)
    grad_b_alpha = torch.empty(n + 3, device=x.device, dtype=torch.float32)
    if M == 0:
        grad_phi.zero_()
        grad_b_alpha.zero_()
    results = (grad_x, grad_phi, grad_b_alpha[:n], grad_b_alpha[n], grad_b_alpha[n + 1], grad_b_alpha[n + 2])
    return grad_x, grad_phi, grad_b_alpha, results
