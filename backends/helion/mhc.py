"""mHC coefficients (arXiv 2512.24880) as Helion kernels: a two-launch forward, a three-launch backward.

Forward:
    1. mix: per block of rows, x @ phi (fp32 accumulation on tensor cores) and sum(x^2) in one pass over x;
       rstd = rsqrt(mean(x^2) + eps), mix = (x @ phi) * rstd.
    2. coefficients: the two sigmoids and the Sinkhorn iterations on [rows, hc, hc] tiles in registers.
Backward:
    1. producer: sigmoid derivatives and the Sinkhorn backward (iterates recomputed from mix into a scratch),
       gz = grad_mix * rstd (in x's dtype, the GEMMs' operand type), the per-row RMS coefficient
       rstd^2 / K * sum_j grad_mix_j mix_j, and per-row partials of grad_b and the alphas;
    2. reducer: those partials summed over the rows in a fixed order (deterministic, no atomics);
    3. MM/RMS backward, one program per block of K looping over all rows (the reduction innermost):
       grad_phi = x^T @ gz and grad_x = gz @ phi^T - coef * x, x read once.
"""

from typing import Optional

import torch
import helion.language as hl

from liger_dispatch import register_backend

from .._mhc import backward_results, forward_outputs
from ._support import DOT_CAPABILITY, LOG2E, PRIORITY, Kernel, bucket, exp2, needs_int64

# ---------------------------------------------------------------- Sinkhorn pieces (inlined by Helion)
# [rows, hc, hc] tiles: dim 2 runs along a row of the hc x hc matrix, dim 1 along a column.


def _row_softmax(logits):
    e = exp2((logits - torch.amax(logits, dim=2, keepdim=True)) * LOG2E)
    return e / torch.sum(e, dim=2, keepdim=True)


def _inv_row_sums(p, eps):
    return 1.0 / (torch.sum(p, dim=2, keepdim=True) + eps)


def _inv_col_sums(p, eps):
    return 1.0 / (torch.sum(p, dim=1, keepdim=True) + eps)


def _first_iterate(logits, eps):
    """Row softmax, + eps, columns normalized: (the softmax, 1 / (column sums + eps), the first iterate)."""
    soft = _row_softmax(logits)
    shifted = soft + eps
    col_inv = _inv_col_sums(shifted, eps)
    return soft, col_inv, shifted * col_inv


def _round_parts(p, eps):
    """One Sinkhorn round's pieces: (1 / (row sums + eps), the rows normalized, 1 / (their column sums + eps))."""
    row_inv = _inv_row_sums(p, eps)
    rows = p * row_inv
    return row_inv, rows, _inv_col_sums(rows, eps)


def _round(p, eps):
    """One Sinkhorn round: rows, then columns."""
    _, rows, col_inv = _round_parts(p, eps)
    return rows * col_inv


# ---------------------------------------------------------------- forward


def _columns_block(n):
    """All n = hc^2 + 2 hc columns in one block, at least 16 wide (tl.dot's minimum)."""
    return max(16, 1 << (n - 1).bit_length())


def _mix(x: torch.Tensor, phi: torch.Tensor, mix: torch.Tensor, rstd: torch.Tensor, rms_eps: float) -> None:
    M, K = x.shape
    n = hl.specialize(phi.size(1))
    block_m = hl.register_block_size(M)
    block_k = hl.register_block_size(K)
    for tile_m, tile_n in hl.tile([M, n], block_size=[block_m, _columns_block(n)]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        squares = hl.zeros([tile_m, block_k], dtype=torch.float32)
        for tile_k in hl.tile(K, block_size=block_k):
            xt = x[tile_m, tile_k]
            acc = hl.dot(xt, phi[tile_k, tile_n].to(x.dtype), acc=acc)
            xf = xt.to(torch.float32)
            squares = squares + xf * xf
        r = torch.rsqrt(torch.sum(squares, dim=1) / K + rms_eps)
        mix[tile_m, tile_n] = acc * r[:, None]
        rstd[tile_m] = r


def _coeffs(
    mix_pre: torch.Tensor, mix_post: torch.Tensor, mix_res: torch.Tensor,
    b_pre: torch.Tensor, b_post: torch.Tensor, b_res: torch.Tensor,
    alpha_pre: torch.Tensor, alpha_post: torch.Tensor, alpha_res: torch.Tensor,
    h_pre: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor,
    tmax: int, pre_eps: float, sinkhorn_eps: float, post_mult: float,
) -> None:
    M = mix_pre.size(0)
    block_m = hl.register_block_size(M)
    for tile_m in hl.tile(M, block_size=block_m):
        z_pre = mix_pre[tile_m, :] * hl.load(alpha_pre, []) + b_pre[None, :]
        h_pre[tile_m, :] = torch.sigmoid(z_pre) + pre_eps
        z_post = mix_post[tile_m, :] * hl.load(alpha_post, []) + b_post[None, :]
        h_post[tile_m, :] = torch.sigmoid(z_post) * post_mult
        logits = mix_res[tile_m, :, :] * hl.load(alpha_res, []) + b_res[None, :, :]
        _, _, p = _first_iterate(logits, sinkhorn_eps)
        for _ in range(tmax - 1):
            p = _round(p, sinkhorn_eps)
        h_res[tile_m, :, :] = p


# ---------------------------------------------------------------- backward


def _coeff_grads(
    mix_pre: torch.Tensor, mix_post: torch.Tensor, mix_res: torch.Tensor,
    b_pre: torch.Tensor, b_post: torch.Tensor, b_res: torch.Tensor,
    alpha_pre: torch.Tensor, alpha_post: torch.Tensor, alpha_res: torch.Tensor, rstd: torch.Tensor,
    grad_pre: Optional[torch.Tensor], grad_post: Optional[torch.Tensor], grad_res: Optional[torch.Tensor],
    gz_pre: torch.Tensor, gz_post: torch.Tensor, gz_res: torch.Tensor, coef: torch.Tensor,
    part_pre: torch.Tensor, part_post: torch.Tensor, part_res: torch.Tensor, part_alpha: torch.Tensor,
    iterates: torch.Tensor, tmax: int, sinkhorn_eps: float, post_mult: float, inv_k: float,
) -> None:
    """Per row: gz = grad_mix * rstd, coef = rstd^2 / K * sum_j grad_mix_j mix_j, and the partials of grad_b
    (d loss / d pre-activation) and of the alphas (that times mix, summed over the row's columns of each kind)."""
    M = mix_pre.size(0)
    block_m = hl.register_block_size(M)
    for tile_m in hl.tile(M, block_size=block_m):
        r = rstd[tile_m]
        a_pre = hl.load(alpha_pre, [])
        a_post = hl.load(alpha_post, [])
        a_res = hl.load(alpha_res, [])
        m_pre = mix_pre[tile_m, :]
        m_post = mix_post[tile_m, :]
        m_res = mix_res[tile_m, :, :]
        if grad_pre is not None:
            s = torch.sigmoid(m_pre * a_pre + b_pre[None, :])
            d_pre = grad_pre[tile_m, :] * s * (1.0 - s)
        else:
            d_pre = torch.zeros_like(m_pre)
        if grad_post is not None:
            s = torch.sigmoid(m_post * a_post + b_post[None, :])
            d_post = grad_post[tile_m, :] * (post_mult * s * (1.0 - s))
        else:
            d_post = torch.zeros_like(m_post)
        if grad_res is not None:
            # Sinkhorn backward: the iterates are recomputed from mix, each round's input kept in `iterates`
            # (this program's rows; Helion puts a CTA barrier between the loops for the global read-after-write),
            # then the rounds are undone last to first. A normalization y = x * inv, inv = 1 / (sum x + eps)
            # along an axis, has dx = inv * (dy - sum(dy * y)) along the same axis.
            soft, col_inv, first = _first_iterate(m_res * a_res + b_res[None, :, :], sinkhorn_eps)
            p = first
            for t in range(tmax - 1):
                iterates[tile_m, t, :, :] = p
                p = _round(p, sinkhorn_eps)
            d_res = grad_res[tile_m, :, :]
            for done in range(tmax - 1):
                row_inv, rows, col_inv_t = _round_parts(iterates[tile_m, tmax - 2 - done, :, :], sinkhorn_eps)
                d_res = col_inv_t * (d_res - torch.sum(d_res * (rows * col_inv_t), dim=1, keepdim=True))
                d_res = row_inv * (d_res - torch.sum(d_res * rows, dim=2, keepdim=True))
            d_res = col_inv * (d_res - torch.sum(d_res * first, dim=1, keepdim=True))
            d_res = soft * (d_res - torch.sum(d_res * soft, dim=2, keepdim=True))
        else:
            d_res = torch.zeros_like(m_res)
        gz_pre[tile_m, :] = (d_pre * (a_pre * r[:, None])).to(gz_pre.dtype)
        gz_post[tile_m, :] = (d_post * (a_post * r[:, None])).to(gz_post.dtype)
        gz_res[tile_m, :, :] = (d_res * (a_res * r[:, None, None])).to(gz_res.dtype)
        dm_pre = torch.sum(d_pre * m_pre, dim=1)
        dm_post = torch.sum(d_post * m_post, dim=1)
        dm_res = torch.sum(torch.sum(d_res * m_res, dim=2), dim=1)
        coef[tile_m] = (r * r * inv_k) * (a_pre * dm_pre + a_post * dm_post + a_res * dm_res)
        part_pre[tile_m, :] = d_pre
        part_post[tile_m, :] = d_post
        part_res[tile_m, :, :] = d_res
        part_alpha[tile_m, 0] = dm_pre
        part_alpha[tile_m, 1] = dm_post
        part_alpha[tile_m, 2] = dm_res


def _sum_partials(part: torch.Tensor, out: torch.Tensor) -> None:
    """out[j] = sum_i part[i, j], always in the same order (per-lane sums over blocks of rows, then across lanes)."""
    M, W = part.shape
    block_w = hl.register_block_size(W)
    block_m = hl.register_block_size(M)
    for tile_w in hl.tile(W, block_size=block_w):
        acc = hl.zeros([block_m, tile_w], dtype=torch.float32)
        for tile_m in hl.tile(M, block_size=block_m):
            acc = acc + part[tile_m, tile_w]
        out[tile_w] = torch.sum(acc, dim=0)


def _mm_rms_backward(
    x: torch.Tensor, phi: torch.Tensor, gz: torch.Tensor, coef: torch.Tensor,
    grad_x: torch.Tensor, grad_phi: torch.Tensor,
) -> None:
    """Per block of K, over all rows: grad_phi = x^T @ gz; grad_x = gz @ phi^T - coef * x."""
    M, K = x.shape
    n = hl.specialize(phi.size(1))
    block_k = hl.register_block_size(K)
    block_m = hl.register_block_size(M)
    for tile_k, tile_n in hl.tile([K, n], block_size=[block_k, _columns_block(n)]):
        acc = hl.zeros([tile_k, tile_n], dtype=torch.float32)
        phi_t = phi[tile_k, tile_n].to(x.dtype)
        for tile_m in hl.tile(M, block_size=block_m):
            xt = x[tile_m, tile_k]
            g = gz[tile_m, tile_n]
            acc = hl.dot(xt.T, g, acc=acc)
            gx = hl.dot(g, phi_t.T, out_dtype=torch.float32)
            grad_x[tile_m, tile_k] = (gx - coef[tile_m][:, None] * xt.to(torch.float32)).to(grad_x.dtype)
        grad_phi[tile_k, tile_n] = acc.to(grad_phi.dtype)


def _mix_config(key) -> dict:
    """64 rows a program, 128-wide K blocks, 3 stages: fits shared memory in fp32 too."""
    _, k_bucket = key
    return {"block_sizes": [64, min(128, max(16, k_bucket))], "num_warps": 8, "num_stages": 3}


def _rows_config(_) -> dict:
    return {"block_sizes": [32], "num_warps": 4, "num_stages": 1}


def _sum_config(_) -> dict:
    return {"block_sizes": [4, 256], "num_warps": 4, "num_stages": 1}


def _mm_backward_config(key) -> dict:
    """64-wide K blocks a program, 128 rows a step."""
    _, k_bucket = key
    return {"block_sizes": [min(64, max(16, k_bucket)), 128], "num_warps": 4, "num_stages": 3}


MIX = Kernel(_mix, "mhc_mix", _mix_config)
COEFFS = Kernel(_coeffs, "mhc_coeffs", _rows_config)
COEFF_GRADS = Kernel(_coeff_grads, "mhc_coeff_grads", _rows_config)
SUM_PARTIALS = Kernel(_sum_partials, "mhc_sum_partials", _sum_config)
MM_RMS_BACKWARD = Kernel(_mm_rms_backward, "mhc_mm_rms_backward", _mm_backward_config)


def _split(t, hc):
    """Views of the pre / post / residual columns of t [..., hc*hc + 2*hc]; the residual one as [..., hc, hc]."""
    return t[..., :hc], t[..., hc:2 * hc], t[..., 2 * hc:].unflatten(-1, (hc, hc))


@register_backend("mhc_coeff_fwd", backend="helion", priority=PRIORITY, capability=DOT_CAPABILITY)
def mhc_coeff_fwd(x, phi, b, alpha_pre, alpha_post, alpha_res, *, hc, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                  sinkhorn_eps=1e-6, post_mult=2.0):
    """x [M, K] -> (h_pre [M, hc], h_post [M, hc], h_res [M, hc, hc], mix [M, n], rstd [M]), fp32."""
    M, K = x.shape
    h_pre, h_post, h_res, mix, rstd = forward_outputs(M, hc, x.device)
    if M == 0:
        return h_pre, h_post, h_res, mix, rstd
    MIX(x, phi, mix, rstd, float(rms_eps), like=x, shape_key=(hc, bucket(K)), int64=needs_int64(x))
    COEFFS(*_split(mix, hc), *_split(b, hc), alpha_pre, alpha_post, alpha_res, h_pre, h_post, h_res,
           int(tmax), float(pre_eps), float(sinkhorn_eps), float(post_mult), like=x, shape_key=hc)
    return h_pre, h_post, h_res, mix, rstd


@register_backend("mhc_coeff_bwd", backend="helion", priority=PRIORITY, capability=DOT_CAPABILITY)
def mhc_coeff_bwd(x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd, grad_h_pre, grad_h_post, grad_h_res, *,
                  hc, tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0):
    """-> (grad_x in x.dtype, grad_phi in phi.dtype, grad_b, grad_alpha_pre, grad_alpha_post, grad_alpha_res)."""
    M, K = x.shape
    n = phi.shape[1]
    grad_x, grad_phi, sums, results = backward_results(x, phi, n)
    if M > 0:
        f32 = dict(dtype=torch.float32, device=x.device)
        gz = torch.empty(M, n, dtype=x.dtype, device=x.device)  # the dtype of the backward GEMMs' operands
        coef = torch.empty(M, **f32)
        part = torch.empty(M, n + 3, **f32)  # per row: grad_b partials, then the three alphas'
        iterates = torch.empty(M, max(1, tmax - 1), hc, hc, **f32) if grad_h_res is not None else None
        COEFF_GRADS(*_split(mix, hc), *_split(b, hc), alpha_pre, alpha_post, alpha_res, rstd,
                    grad_h_pre, grad_h_post, grad_h_res, *_split(gz, hc), coef, *_split(part[:, :n], hc),
                    part[:, n:], iterates, int(tmax), float(sinkhorn_eps), float(post_mult), 1.0 / K,
                    like=x, shape_key=hc, int64=needs_int64(iterates))
        SUM_PARTIALS(part, sums, like=x, shape_key=hc)
        MM_RMS_BACKWARD(x, phi, gz, coef, grad_x, grad_phi, like=x, shape_key=(hc, bucket(K)), int64=needs_int64(x))
    return results
