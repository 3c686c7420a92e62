"""mHC coefficients in Triton: one fused forward kernel, a three-launch backward.

Forward (one launch; two when M is too small to fill the GPU and K is split):
    per block of rows, x @ phi (fp32 accumulation on tensor cores) and sum(x^2) in one pass
    over x, then rstd, mix, the two sigmoids and the Sinkhorn iterations in registers.
Backward (three launches):
    1. coefficient producer: sigmoid derivatives, Sinkhorn backward (iterates recomputed from
       mix, kept in a per-row scratch), grad_mix scaled by rstd, the per-row RMS coefficient,
       per-block partial sums for grad_b and the alphas;
    2. fused MM/RMS backward: grad_x = gz @ phi^T - coef * x and grad_phi = x^T @ gz, where
       gz = grad_mix * rstd and coef = rstd^2 / K * sum_j(grad_mix_j * mix_j)
       (mix = (x @ phi) * rstd, d rstd / dx = -rstd^3 x / K);
    3. deterministic reducer: grad_b and the three alpha grads, and grad_phi when the MM
       kernel split M into groups.
No atomics anywhere: every reduction runs in a fixed order.
Host side: what a call derives from its signature is planned once per signature, and the compiled kernels
are launched directly after the first call (_support.Launch), which keeps the Python cost of a launch near 1 us.
"""

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from liger_dispatch import register_backend

from .._host import BoundedCache, Scratch, contiguous, sm_count, unit_column_stride
from .._launch import LaunchKnobs, given
from .._mhc import backward_results, cdiv, columns, forward_outputs
from ._support import CAPABILITY, INTERPRETING, LOG2E, PRIORITY, Launch, direct_target

SUPPORTED_HC = (2, 4, 8)


def _unsupported(*args, hc, **kwargs):
    if hc not in SUPPORTED_HC:
        return f"hc={hc} is not supported (hc in {SUPPORTED_HC})"
    return None


MHC_CAPABILITY = dataclasses.replace(CAPABILITY, predicate=_unsupported)


# ----------------------------------------------------------------------------------------------
# Device helpers. Residual matrices live in [rows, R, HC] tensors; R may exceed HC (padding
# rows, all-zero after the softmax) because tl.dot needs at least 16 columns.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _softmax_colnorm(logits, valid, eps):
    """Row softmax, + eps, column normalization. Returns (softmax, first iterate, 1/colsum)."""
    e = tl.exp2((logits - tl.max(logits, axis=2)[:, :, None]) * LOG2E)
    p = e / tl.sum(e, axis=2)[:, :, None]
    q = tl.where(valid, p + eps, 0.0)
    cinv = 1.0 / (tl.sum(q, axis=1) + eps)
    return p, q * cinv[:, None, :], cinv


@triton.jit
def _rowcol_step(a, eps):
    """One Sinkhorn round: rows then columns. Returns (row-normalized, result, 1/rowsum, 1/colsum)."""
    rinv = 1.0 / (tl.sum(a, axis=2) + eps)
    rn = a * rinv[:, :, None]
    cinv = 1.0 / (tl.sum(rn, axis=1) + eps)
    return rn, rn * cinv[:, None, :], rinv, cinv


@triton.jit
def _coeff_epilogue(
    acc_pp, acc_res, sumsq, rows, b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr,
    hpre_ptr, hpost_ptr, hres_ptr, mix_ptr, rstd_ptr,
    M, K, rms_eps, pre_eps, sinkhorn_eps, post_mult,
    HC: tl.constexpr, PP: tl.constexpr, RR: tl.constexpr, TMAX: tl.constexpr,
):
    """acc_pp [BM, PP]: (x @ phi) columns 0..2HC-1, zero beyond. acc_res [BM, RR, HC]: columns
    2HC + r*HC + c, zero for r >= HC. sumsq [BM]: sum(x^2)."""
    N: tl.constexpr = HC * HC + 2 * HC
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    rstd = tl.rsqrt(sumsq / K + rms_eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)

    j = tl.arange(0, PP)[None, :]
    is_pre = j < HC
    pp_ok = row_ok[:, None] & (j < 2 * HC)
    mix_pp = acc_pp * rstd[:, None]
    tl.store(mix_ptr + rows64[:, None] * N + j, mix_pp, mask=pp_ok)
    alpha_pp = tl.where(is_pre, tl.load(a_pre_ptr), tl.load(a_post_ptr))
    s = tl.sigmoid(mix_pp * alpha_pp + tl.load(b_ptr + j, mask=j < 2 * HC, other=0.0))
    tl.store(hpre_ptr + rows64[:, None] * HC + j, s + pre_eps, mask=pp_ok & is_pre)
    tl.store(hpost_ptr + rows64[:, None] * HC + (j - HC), s * post_mult, mask=pp_ok & ~is_pre)

    r = tl.arange(0, RR)[None, :, None]
    rc = r * HC + tl.arange(0, HC)[None, None, :]
    valid = r < HC
    res_ok = row_ok[:, None, None] & valid
    rows3 = rows64[:, None, None]
    mix_res = acc_res * rstd[:, None, None]
    tl.store(mix_ptr + rows3 * N + 2 * HC + rc, mix_res, mask=res_ok)
    logits = mix_res * tl.load(a_res_ptr) + tl.load(b_ptr + 2 * HC + rc, mask=valid, other=0.0)
    _, a, _ = _softmax_colnorm(logits, valid, sinkhorn_eps)
    for _t in range(1, TMAX):
        _, a, _, _ = _rowcol_step(a, sinkhorn_eps)
    tl.store(hres_ptr + rows3 * (HC * HC) + rc, a, mask=res_ok)


# ----------------------------------------------------------------------------------------------
# Forward kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_kernel(
    x_ptr, phi_ptr, b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr,
    hpre_ptr, hpost_ptr, hres_ptr, mix_ptr, rstd_ptr, ws_ptr,
    M, K, stride_xm, rms_eps, pre_eps, sinkhorn_eps, post_mult,
    HC: tl.constexpr, PP: tl.constexpr, RR: tl.constexpr, TMAX: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr, K_ITERS: tl.constexpr, SPLIT: tl.constexpr, CAST_F32: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Grid (row blocks, SPLIT). SPLIT == 1: the whole op. Otherwise each program writes its
    K-slice partials (x @ phi and sum(x^2)) to ws [SPLIT, M, PP + RR*HC + 1] for _fwd_split_epilogue."""
    N: tl.constexpr = HC * HC + 2 * HC
    RES: tl.constexpr = RR * HC
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    jp = tl.arange(0, PP)[None, :]
    jr = tl.arange(0, RES)[None, :]
    phi_pp = phi_ptr + jp
    phi_res = phi_ptr + 2 * HC + jr

    acc_pp = tl.zeros((BM, PP), tl.float32)
    acc_res = tl.zeros((BM, RES), tl.float32)
    sumsq = tl.zeros((BM,), tl.float32)
    # Loop bounds are constexpr: the interpreter (numpy 2) cannot take runtime ones. The last
    # K slice may run fully masked iterations.
    for it in range(0, K_ITERS):
        k = (pid_s * K_ITERS + it) * BK + tl.arange(0, BK)
        k_ok = k < K
        xt = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        xf = xt.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
        kc = k[:, None] * N
        p_pp = tl.load(phi_pp + kc, mask=k_ok[:, None] & (jp < 2 * HC), other=0.0)
        p_res = tl.load(phi_res + kc, mask=k_ok[:, None] & (jr < HC * HC), other=0.0)
        if CAST_F32:
            xt = xf
            p_pp = p_pp.to(tl.float32)
            p_res = p_res.to(tl.float32)
        acc_pp = tl.dot(xt, p_pp, acc_pp, input_precision=DOT_PREC)
        acc_res = tl.dot(xt, p_res, acc_res, input_precision=DOT_PREC)

    if SPLIT == 1:
        _coeff_epilogue(
            acc_pp, tl.reshape(acc_res, (BM, RR, HC)), sumsq, rows, b_ptr, a_pre_ptr, a_post_ptr,
            a_res_ptr, hpre_ptr, hpost_ptr, hres_ptr, mix_ptr, rstd_ptr,
            M, K, rms_eps, pre_eps, sinkhorn_eps, post_mult, HC, PP, RR, TMAX,
        )
    else:
        ws_rows = ws_ptr + (pid_s * M + rows).to(tl.int64) * (PP + RES + 1)
        tl.store(ws_rows[:, None] + jp, acc_pp, mask=row_ok[:, None])
        tl.store(ws_rows[:, None] + PP + jr, acc_res, mask=row_ok[:, None])
        tl.store(ws_rows + PP + RES, sumsq, mask=row_ok)


@triton.jit
def _fwd_split_epilogue(
    ws_ptr, b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr,
    hpre_ptr, hpost_ptr, hres_ptr, mix_ptr, rstd_ptr,
    M, K, rms_eps, pre_eps, sinkhorn_eps, post_mult,
    HC: tl.constexpr, PP: tl.constexpr, RR: tl.constexpr, TMAX: tl.constexpr, BM: tl.constexpr,
    SPLIT: tl.constexpr,
):
    RES: tl.constexpr = RR * HC
    W: tl.constexpr = PP + RES + 1
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    jp = tl.arange(0, PP)[None, :]
    rc = tl.arange(0, RR)[None, :, None] * HC + tl.arange(0, HC)[None, None, :]
    acc_pp = tl.zeros((BM, PP), tl.float32)
    acc_res = tl.zeros((BM, RR, HC), tl.float32)
    sumsq = tl.zeros((BM,), tl.float32)
    for s in range(SPLIT):
        ws_rows = ws_ptr + (s * M + rows).to(tl.int64) * W
        acc_pp += tl.load(ws_rows[:, None] + jp, mask=row_ok[:, None], other=0.0)
        acc_res += tl.load(ws_rows[:, None, None] + PP + rc, mask=row_ok[:, None, None], other=0.0)
        sumsq += tl.load(ws_rows + PP + RES, mask=row_ok, other=0.0)
    _coeff_epilogue(
        acc_pp, acc_res, sumsq, rows, b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr,
        hpre_ptr, hpost_ptr, hres_ptr, mix_ptr, rstd_ptr,
        M, K, rms_eps, pre_eps, sinkhorn_eps, post_mult, HC, PP, RR, TMAX,
    )


# ----------------------------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _bwd_coeff_kernel(
    mix_ptr, rstd_ptr, b_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, gpre_ptr, gpost_ptr, gres_ptr,
    gz_ptr, coef_ptr, part_ptr, hist_ptr,
    s_gpre_m, s_gpre_h, s_gpost_m, s_gpost_h, s_gres_m, s_gres_i, s_gres_j, M, K, sinkhorn_eps, post_mult,
    HC: tl.constexpr, TMAX: tl.constexpr, BR: tl.constexpr,
    HAS_PRE: tl.constexpr, HAS_POST: tl.constexpr, HAS_RES: tl.constexpr,
):
    """Per block of BR rows: gz = grad_mix * rstd [M, N] (dot dtype), coef [M] and the block's
    partial sums part[block] = (grad_b [N], grad_alpha_pre, grad_alpha_post, grad_alpha_res)."""
    N: tl.constexpr = HC * HC + 2 * HC
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    h = tl.arange(0, HC)[None, :]
    mix_rows = mix_ptr + rows64[:, None] * N
    gz_rows = gz_ptr + rows64[:, None] * N
    part = part_ptr + pid * (N + 3)
    out_ty = gz_ptr.dtype.element_ty
    row_ok2 = row_ok[:, None]

    # h_pre = sigmoid(mix * alpha_pre + b) + pre_eps
    mix_pre = tl.load(mix_rows + h, mask=row_ok2, other=0.0)
    a_pre = tl.load(a_pre_ptr)
    if HAS_PRE:
        s = tl.sigmoid(mix_pre * a_pre + tl.load(b_ptr + h))
        g = tl.load(gpre_ptr + rows64[:, None] * s_gpre_m + h * s_gpre_h, mask=row_ok2, other=0.0)
        d_pre = g.to(tl.float32) * s * (1.0 - s)
    else:
        d_pre = tl.zeros((BR, HC), tl.float32)
    tl.store(gz_rows + h, (d_pre * (a_pre * rstd[:, None])).to(out_ty), mask=row_ok2)
    tl.store(part + h, tl.sum(d_pre, axis=0)[None, :])
    dm_pre = tl.sum(d_pre * mix_pre, axis=1)

    # h_post = sigmoid(mix * alpha_post + b) * post_mult
    mix_post = tl.load(mix_rows + HC + h, mask=row_ok2, other=0.0)
    a_post = tl.load(a_post_ptr)
    if HAS_POST:
        s = tl.sigmoid(mix_post * a_post + tl.load(b_ptr + HC + h))
        g = tl.load(gpost_ptr + rows64[:, None] * s_gpost_m + h * s_gpost_h, mask=row_ok2, other=0.0)
        d_post = g.to(tl.float32) * post_mult * s * (1.0 - s)
    else:
        d_post = tl.zeros((BR, HC), tl.float32)
    tl.store(gz_rows + HC + h, (d_post * (a_post * rstd[:, None])).to(out_ty), mask=row_ok2)
    tl.store(part + HC + h, tl.sum(d_post, axis=0)[None, :])
    dm_post = tl.sum(d_post * mix_post, axis=1)

    # h_res = Sinkhorn(mix * alpha_res + b)
    rows3 = rows64[:, None, None]
    i = tl.arange(0, HC)[None, :, None]
    jj = tl.arange(0, HC)[None, None, :]
    rc = i * HC + jj
    row_ok3 = row_ok[:, None, None]
    mix_res = tl.load(mix_rows[:, :, None] + 2 * HC + rc, mask=row_ok3, other=0.0)
    a_res = tl.load(a_res_ptr)
    if HAS_RES:
        logits = mix_res * a_res + tl.load(b_ptr + 2 * HC + rc)
        p, a0, c0inv = _softmax_colnorm(logits, rc >= 0, sinkhorn_eps)
        # Iterates a_0 .. a_{TMAX-2}; the backward of round t needs a_{t-1}.
        hist = hist_ptr + rows3 * ((TMAX - 1) * HC * HC) + rc
        if TMAX > 1:
            tl.store(hist, a0, mask=row_ok3)
        a = a0
        for t in range(1, TMAX - 1):
            _, a, _, _ = _rowcol_step(a, sinkhorn_eps)
            tl.store(hist + t * (HC * HC), a, mask=row_ok3)
        tl.debug_barrier()
        g = tl.load(gres_ptr + rows3 * s_gres_m + i * s_gres_i + jj * s_gres_j, mask=row_ok3, other=0.0)
        g = g.to(tl.float32)
        for u in range(0, TMAX - 1):
            prev = tl.load(hist + (TMAX - 2 - u) * (HC * HC), mask=row_ok3, other=0.0)
            rn, a, rinv, cinv = _rowcol_step(prev, sinkhorn_eps)
            g_rn = (g - tl.sum(g * a, axis=1)[:, None, :]) * cinv[:, None, :]
            g = (g_rn - tl.sum(g_rn * rn, axis=2)[:, :, None]) * rinv[:, :, None]
        g_q = (g - tl.sum(g * a0, axis=1)[:, None, :]) * c0inv[:, None, :]
        d_res = p * (g_q - tl.sum(g_q * p, axis=2)[:, :, None])
    else:
        d_res = tl.zeros((BR, HC, HC), tl.float32)
    tl.store(gz_rows[:, :, None] + 2 * HC + rc, (d_res * (a_res * rstd[:, None, None])).to(out_ty), mask=row_ok3)
    tl.store(part + 2 * HC + rc, tl.sum(d_res, axis=0)[None, :, :])
    dm_res = tl.sum(tl.sum(d_res * mix_res, axis=2), axis=1)

    tl.store(part + N, tl.sum(dm_pre, axis=0))
    tl.store(part + N + 1, tl.sum(dm_post, axis=0))
    tl.store(part + N + 2, tl.sum(dm_res, axis=0))
    gm_dot_mix = a_pre * dm_pre + a_post * dm_post + a_res * dm_res
    tl.store(coef_ptr + rows, rstd * rstd / K * gm_dot_mix, mask=row_ok)


@triton.jit
def _bwd_mm_kernel(
    x_ptr, phi_ptr, gz_ptr, coef_ptr, gx_ptr, gphi_ptr,
    M, K, stride_xm, stride_gxm,
    HC: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, M_ITERS: tl.constexpr,
    GROUPED: tl.constexpr, CAST_F32: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Grid (row groups, K blocks). grad_x = gz @ phi^T - coef * x for the group's rows and K
    block; grad_phi's K block summed over the group's rows: final (phi dtype) into gphi [K, N]
    when not GROUPED, else fp32 partials into gphi [groups, K, N]."""
    N: tl.constexpr = HC * HC + 2 * HC
    pid_g = tl.program_id(0)
    pid_k = tl.program_id(1)
    k = pid_k * BK + tl.arange(0, BK)
    k_ok = k < K
    j = tl.arange(0, NP)[None, :]
    phi = tl.load(phi_ptr + k[:, None] * N + j, mask=k_ok[:, None] & (j < N), other=0.0)
    if CAST_F32:
        phi = phi.to(tl.float32)
    phi_t = tl.trans(phi)
    acc = tl.zeros((BK, NP), tl.float32)
    for it in range(0, M_ITERS):
        rows = (pid_g * M_ITERS + it) * BM + tl.arange(0, BM)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)[:, None]
        xk_ok = row_ok[:, None] & k_ok[None, :]
        xt = tl.load(x_ptr + rows64 * stride_xm + k[None, :], mask=xk_ok, other=0.0)
        gz = tl.load(gz_ptr + rows64 * N + j, mask=row_ok[:, None] & (j < N), other=0.0)
        coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
        xf = xt.to(tl.float32)
        if CAST_F32:
            xt = xf
            gz = gz.to(tl.float32)
        gx = tl.dot(gz, phi_t, input_precision=DOT_PREC) - coef[:, None] * xf
        tl.store(gx_ptr + rows64 * stride_gxm + k[None, :], gx.to(gx_ptr.dtype.element_ty), mask=xk_ok)
        acc = tl.dot(tl.trans(xt), gz, acc, input_precision=DOT_PREC)
    out = gphi_ptr + k[:, None] * N + j
    if GROUPED:
        out += pid_g.to(tl.int64) * K * N
    tl.store(out, acc.to(gphi_ptr.dtype.element_ty), mask=k_ok[:, None] & (j < N))


@triton.jit
def _bwd_reduce_kernel(
    phi_ws_ptr, gphi_ptr, part_ptr, gb_ptr, K, n_groups, n_blocks, n_kblocks,
    HC: tl.constexpr, NP: tl.constexpr, BK: tl.constexpr, G_ITERS: tl.constexpr,
    BB: tl.constexpr, B_ITERS: tl.constexpr, NBP: tl.constexpr,
):
    """Programs [0, n_kblocks): grad_phi = sum over groups of the MM partials. The last program:
    grad_b and the alpha grads (gb [N + 3]) = sum over blocks of the producer partials."""
    N: tl.constexpr = HC * HC + 2 * HC
    pid = tl.program_id(0)
    if pid < n_kblocks:
        k = pid * BK + tl.arange(0, BK)[:, None]
        j = tl.arange(0, NP)[None, :]
        ok = (k < K) & (j < N)
        acc = tl.zeros((BK, NP), tl.float32)
        for g in range(G_ITERS):
            acc += tl.load(phi_ws_ptr + g * (K * N) + k * N + j, mask=ok & (g < n_groups), other=0.0)
        tl.store(gphi_ptr + k * N + j, acc.to(gphi_ptr.dtype.element_ty), mask=ok)
    else:
        c = tl.arange(0, NBP)[None, :]
        sums = tl.zeros((BB, NBP), tl.float32)
        for it in range(B_ITERS):
            blk = it * BB + tl.arange(0, BB)[:, None]
            sums += tl.load(part_ptr + blk * (N + 3) + c, mask=(blk < n_blocks) & (c < N + 3), other=0.0)
        c1 = tl.arange(0, NBP)
        tl.store(gb_ptr + c1, tl.sum(sums, axis=0), mask=c1 < N + 3)


# ----------------------------------------------------------------------------------------------
# Host side. Everything but the data follows from a call's signature (shapes, strides, dtypes,
# device, options): a plan computes the grids, constexprs and buffer shapes once per signature, so
# a call costs its allocations and its launches. Loop trip counts are constexpr; those that follow
# M are rounded up to powers of two so a run with varying M compiles a handful of kernel variants.
# ----------------------------------------------------------------------------------------------

_F32 = torch.float32


def _pow2(v: int) -> int:
    return 1 << (max(1, v) - 1).bit_length()


_plans = BoundedCache("triton mhc plans", 1024)  # one per call signature


def _plan(make, key, *args):
    """make(*args), made once per (make, key)."""
    return _plans.get((make, key), lambda: make(*args))


def _dot_setup(x_dtype: torch.dtype, phi_dtype: torch.dtype):
    """(dtype of the tl.dot operands, cast-to-fp32 flag, tl.dot input precision).

    16-bit inputs of one dtype go to the tensor cores as they are. Anything else is multiplied in fp32 on the
    FMA units ("ieee"): exact fp32 like the reference, and the 3-pass tf32 alternative spills registers."""
    if x_dtype == phi_dtype and x_dtype in (torch.bfloat16, torch.float16):
        # The interpreter's tl.dot reads bf16 operands as their raw bits: it gets them in fp32.
        return x_dtype, INTERPRETING.value and x_dtype == torch.bfloat16, "tf32"
    return _F32, True, "ieee"


def fwd_config(M: int, K: int, n_sms: int, fp32: bool) -> dict:
    """The tallest row block whose blocks still make about one wave: every program reads its K x N phi
    slice through L2, so that traffic is N / BM of the x traffic. Where even 16-row blocks leave most SMs
    idle, K is split (second, tiny launch)."""
    for bm in (64, 32, 16):
        if 10 * cdiv(M, bm) >= 9 * n_sms:
            break
    bk = 64 if fp32 else 256 if bm <= 32 else 128
    bk = max(16, min(bk, _pow2(K)))
    programs = cdiv(M, bm)
    split = 1
    if 4 * programs < 3 * n_sms:
        split = min(_pow2(cdiv(n_sms, programs)), cdiv(K, bk))
    # 64-row blocks at one wave: 4 warps with 6 stages in flight (95 us at T*C = 2048*4096 on the H200; 8 warps with 4
    # stages 108, 4 with 4 100: `mhc-kernels --sweep`)
    stages = 3 if fp32 else 6 if bm == 64 else 4
    return dict(BM=bm, BK=bk, split=split, num_warps=4, num_stages=stages)


def bwd_config(M: int, K: int, hc: int, n_sms: int, fp32: bool) -> dict:
    """MM/RMS backward: K blocks x row groups, enough programs to fill every SM's slots once. Tiles sized
    to stay clear of register spills (hc = 8 has 128 padded columns; fp32 multiplies on the FMA units)."""
    wide = _pow2(columns(hc)) > 32
    if fp32:
        bm, bk, warps = (32, 16, 8) if wide else (64, 32, 8)
    else:
        bm, bk, warps = 64, 64, 8 if wide else 4
    bk = max(16, min(bk, _pow2(K)))
    slots = n_sms * (2 if warps == 8 else 4)
    groups = cdiv(slots, cdiv(K, bk))
    # the coefficient producer (latency-bound Sinkhorn backward): the tallest row blocks that still make about one
    # wave (H200, `mhc-kernels --sweep`: M = 8192 backward 197-202 us at 64 rows against 216-220 at 32; M = 2048
    # 42 us at 16 rows against 57-60 at 32); hc = 8's [rows, 8, 8] tiles stay at <= 32 rows (registers)
    for br in (64, 32, 16) if hc <= 4 else (32, 16):
        if 10 * cdiv(M, br) >= 9 * n_sms:
            break
    return dict(BM=bm, BK=bk, groups=groups, BR=br, num_warps=warps, num_stages=3)


def _fwd_tiles(hc: int):
    """(PP, RR): pre/post columns and residual rows of the forward tiles, at least 16 columns each."""
    return max(16, _pow2(2 * hc)), max(16, hc * hc) // hc


def _operands(x, phi, b):
    """x with unit column stride (its row stride may be anything), phi and b contiguous."""
    return unit_column_stride(x), *contiguous(phi, b)


def _signature(x, phi, hc, tmax, scalars):
    """The arguments of a plan, launch knobs aside."""
    return (*x.shape, x.stride(0), hc, tmax, x.dtype, phi.dtype, x.device, scalars)


@dataclasses.dataclass(frozen=True)
class ForwardLaunch:
    """Launch knobs of the forward (fwd_config's keys); None: fwd_config's choice."""

    BM: Optional[int] = None
    BK: Optional[int] = None
    split: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class BackwardLaunch:
    """Launch knobs of the backward (bwd_config's keys); None: bwd_config's choice."""

    BM: Optional[int] = None
    BK: Optional[int] = None
    groups: Optional[int] = None
    BR: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None


FWD_LAUNCH = LaunchKnobs("triton mhc_coeff_fwd", ForwardLaunch())
BWD_LAUNCH = LaunchKnobs("triton mhc_coeff_bwd", BackwardLaunch())


class _FwdPlan:
    __slots__ = ("ws_shape", "main", "epilogue")

    def __init__(self, M, K, stride_xm, hc, tmax, x_dtype, phi_dtype, device, scalars, knobs):
        self.ws_shape = self.main = self.epilogue = None
        if M == 0:
            return
        _, cast_f32, prec = _dot_setup(x_dtype, phi_dtype)
        cfg = fwd_config(M, K, sm_count(device), cast_f32) | given(knobs)
        bm, bk = cfg["BM"], cfg["BK"]
        k_iters = cdiv(cdiv(K, bk), cfg["split"])
        split = cdiv(cdiv(K, bk), k_iters)
        pp, rr = _fwd_tiles(hc)
        tiles = dict(HC=hc, PP=pp, RR=rr, TMAX=tmax)
        self.main = Launch(
            _fwd_kernel, (cdiv(M, bm), split), (M, K, stride_xm, *scalars), **tiles, BM=bm, BK=bk, K_ITERS=k_iters,
            SPLIT=split, CAST_F32=cast_f32, DOT_PREC=prec, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if split > 1:
            self.ws_shape = (split, M, pp + rr * hc + 1)
            self.epilogue = Launch(_fwd_split_epilogue, (cdiv(M, 32),), (M, K, *scalars), **tiles, BM=32,
                                    SPLIT=split, num_warps=4)


@register_backend("mhc_coeff_fwd", backend="triton", priority=PRIORITY, capability=MHC_CAPABILITY)
def mhc_coeff_fwd(
    x, phi, b, alpha_pre, alpha_post, alpha_res, *,
    hc, tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0,
):
    x, phi, b = _operands(x, phi, b)
    scalars = (float(rms_eps), float(pre_eps), float(sinkhorn_eps), float(post_mult))
    signature = _signature(x, phi, hc, tmax, scalars)
    # the other tensors' dtypes too: the kept compiled kernels are specialized on them
    dtypes = (b.dtype, alpha_pre.dtype, alpha_post.dtype, alpha_res.dtype)
    knobs = FWD_LAUNCH.forced
    plan = _plan(_FwdPlan, (*signature, dtypes, knobs), *signature, knobs)
    dev = x.device
    pre, post, res, mix, rstd = forward_outputs(x.shape[0], hc, dev)
    if plan.main is None:
        return pre, post, res, mix, rstd
    target = direct_target(x, phi, b, alpha_pre, alpha_post, alpha_res)
    params = (b, alpha_pre, alpha_post, alpha_res, pre, post, res, mix, rstd)
    if plan.epilogue is None:
        plan.main(target, x, phi, *params, mix)
    else:
        ws = torch.empty(*plan.ws_shape, device=dev, dtype=_F32)
        plan.main(target, x, phi, *params, ws)
        plan.epilogue(target, ws, *params)
    return pre, post, res, mix, rstd


class _BwdPlan:
    __slots__ = ("n", "dot_dtype", "scratch", "coeff", "mm", "reduce")

    def __init__(self, M, K, stride_xm, hc, tmax, x_dtype, phi_dtype, device, scalars, knobs, grads):
        """grads: (dtype, strides) of each upstream gradient, None where it is absent."""
        n = self.n = columns(hc)
        dot_dtype, cast_f32, prec = _dot_setup(x_dtype, phi_dtype)
        self.dot_dtype = dot_dtype
        if M == 0:
            return
        cfg = bwd_config(M, K, hc, sm_count(device), cast_f32) | given(knobs)

        # 1. coefficient producer
        br = cfg["BR"]
        n_blocks = cdiv(M, br)
        has_pre, has_post, has_res = (g is not None for g in grads)
        strides = [s for g, ndim in zip(grads, (2, 2, 3)) for s in (g[1] if g else (0,) * ndim)]
        # gz, coef, the producer's per-block partials, its Sinkhorn iterates, the MM's per-group grad_phi partials
        scratch = {"gz": (dot_dtype, (M, n)), "coef": (_F32, (M,)), "part": (_F32, (n_blocks, n + 3))}
        if has_res and tmax > 1:
            scratch["hist"] = (_F32, (M, tmax - 1, hc, hc))
        self.coeff = Launch(_bwd_coeff_kernel, (n_blocks,), (*strides, M, K, *scalars), HC=hc, TMAX=tmax, BR=br,
                             HAS_PRE=has_pre, HAS_POST=has_post, HAS_RES=has_res, num_warps=4)

        # 2. fused MM/RMS backward
        bm, bk = cfg["BM"], cfg["BK"]
        m_blocks = cdiv(M, bm)
        m_iters = _pow2(cdiv(m_blocks, cfg["groups"]))
        groups = cdiv(m_blocks, m_iters)
        if groups > 1:
            scratch["phi_ws"] = (_F32, (groups, K, n))
        self.scratch = Scratch(scratch)
        self.mm = Launch(_bwd_mm_kernel, (groups, cdiv(K, bk)), (M, K, stride_xm, K), HC=hc,
                          NP=max(16, _pow2(n)), BM=bm, BK=bk, M_ITERS=m_iters, GROUPED=groups > 1,
                          CAST_F32=cast_f32, DOT_PREC=prec, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

        # 3. deterministic reducer: grad_phi over the row groups (if any), grad_b and the alphas
        rbk, rbb = 2048 // max(16, _pow2(n)), 32
        reduce_kblocks = cdiv(K, rbk) if groups > 1 else 0
        self.reduce = Launch(_bwd_reduce_kernel, (reduce_kblocks + 1,), (K, groups, n_blocks, reduce_kblocks),
                              HC=hc, NP=_pow2(n), BK=rbk, G_ITERS=_pow2(groups), BB=rbb,
                              B_ITERS=_pow2(cdiv(n_blocks, rbb)), NBP=_pow2(n + 3), num_warps=4)

    def compiled_on(self, target) -> bool:
        """Every launch has its compiled kernel for the target (device, alignment): they can all take addresses."""
        return target is not None and all(target[0] in launch.compiled for launch in (self.coeff, self.mm, self.reduce))


def _grad_key(g):
    return None if g is None else (g.dtype, g.stride())


@register_backend("mhc_coeff_bwd", backend="triton", priority=PRIORITY, capability=MHC_CAPABILITY)
def mhc_coeff_bwd(
    x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd, grad_h_pre, grad_h_post, grad_h_res, *,
    hc, tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0,
):
    x, phi, b = _operands(x, phi, b)
    mix, rstd = contiguous(mix, rstd)
    scalars = (float(sinkhorn_eps), float(post_mult))
    signature = _signature(x, phi, hc, tmax, scalars)
    grads = (_grad_key(grad_h_pre), _grad_key(grad_h_post), _grad_key(grad_h_res))
    dtypes = (b.dtype, alpha_pre.dtype, alpha_post.dtype, alpha_res.dtype, mix.dtype, rstd.dtype)
    knobs = BWD_LAUNCH.forced
    plan = _plan(_BwdPlan, (*signature, grads, dtypes, knobs), *signature, knobs, grads)
    M, K = x.shape
    grad_x, grad_phi, grad_b_alpha, results = backward_results(x, phi, plan.n)
    if M == 0:
        return results
    target = direct_target(x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd, grad_h_pre, grad_h_post,
                            grad_h_res)
    # one allocation for the scratch buffers, held (memory) until the launches are enqueued
    memory, scratch = plan.scratch.allocate(x.device, addresses=plan.compiled_on(target))
    gz, coef, part = scratch["gz"], scratch["coef"], scratch["part"]
    hist, phi_ws = scratch.get("hist", mix), scratch.get("phi_ws", grad_phi)
    plan.coeff(target, mix, rstd, b, alpha_pre, alpha_post, alpha_res,
               mix if grad_h_pre is None else grad_h_pre, mix if grad_h_post is None else grad_h_post,
               mix if grad_h_res is None else grad_h_res, gz, coef, part, hist)
    plan.mm(target, x, phi, gz, coef, grad_x, phi_ws)
    plan.reduce(target, phi_ws, grad_phi, part, grad_b_alpha)
    return results
