"""mHC coefficients in CuTeDSL: x @ phi and the backward's two products on tensor cores (warp-level TF32 MMA).

x @ phi has only n = hc*hc + 2*hc columns (24 at hc = 4), so the products are fed to m16n8k8 MMAs straight
from global memory, without shared memory: the reduction index of a product may be permuted freely as long
as both operands agree, so each thread loads contiguous elements of a row of x (whole 16-byte vectors) and
hands them to the MMAs in the order the fragments want. bf16 / fp16 values are exact in TF32; an fp32 operand is
split into its TF32 rounding and the remainder (three MMAs instead of one), so fp32 inputs keep fp32
accuracy; the backward's gz is rounded to TF32 (2^-11) when x and phi are 16-bit.

  forward, two launches:
    1. per warp, 16 rows over its share of K: the partial x @ phi and sum(x^2) (grid: row blocks x K splits);
    2. epilogue, one thread per row: the partials summed in a fixed order, rstd, mix, the sigmoids and the
       Sinkhorn iterations in registers.
  backward, three launches:
    1. coefficient producer, one thread per row: sigmoid derivatives, the Sinkhorn backward (each round's
       input rebuilt from its output and the saved denominators), gz = grad_mix * rstd, the RMS
       coefficient rstd^2 / K * sum_j(grad_mix_j * mix_j), per-CTA partials of grad_b and the alphas;
    2. MM/RMS backward, per warp 8 * vec columns of x over a group of rows: the group's grad_phi = x^T @ gz,
       and grad_x = gz @ phi^T - coef * x computed as (phi @ gz^T)^T, so that each accumulator lands on the
       thread that already holds those elements of x;
    3. reducer: grad_phi over the row groups, grad_b and the alphas over the producer's CTAs.
Every reduction runs in a fixed order; there are no atomics.

Registered after Triton and before Helion: on the H200 Triton's kernels are still faster at the design's
shapes (benchmarks/NOTES.md), so auto mode picks these only where Triton cannot serve (hc = 3, say).
"""

import math
from dataclasses import dataclass

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from liger_dispatch import register_backend

from .._host import contiguous, sm_count
from .._launch import LaunchKnobs
from .._mhc import backward_results, cdiv, columns, forward_outputs
from . import _row
from ._mhc_rows import dot, sigmoid, sinkhorn, sinkhorn_backward
from ._support import CUTE_DTYPE, Launcher, cache, capability, compile_kernel, pick_vec
from ._warp_mma import (EXACT, ROUNDED, SPLIT, WarpMma, chunk_values, flag, issue_chunk, masked_at, row_values,
                        tf32_parts)

MHC_PRIORITY = 25  # after triton (20), before helion (30): Triton's kernels are faster on the H200 (NOTES.md)
MAX_HC = 8
MMA_ROWS = 16  # rows of x a forward warp multiplies
FWD_WARPS = 4  # a forward CTA's warps take 16 rows each and walk the same columns (phi^T loads meet in L1)
MM_WARPS = 4
EPILOGUE_THREADS = 128
PRODUCER_THREADS = 128
REDUCE_THREADS = 256
_F32 = torch.float32


@dataclass(frozen=True)
class ForwardLaunch:
    """Launch shape of MixPartials (benchmarks/mhc_kernels.py --sweep; measured best on the H200 by default)."""

    cols: int = 16  # columns of x a thread takes a row and k-block (contiguous, several 16-byte loads), at most
    unroll: int = 1  # k-blocks whose loads are issued together
    warps_per_sm: int = 16  # what the grid (its K splits) aims to keep resident


@dataclass(frozen=True)
class BackwardLaunch:
    """Launch shape of MatmulBackward (as ForwardLaunch)."""

    max_vec: int = 4  # columns of x a thread takes, at most
    unroll: int = 2  # steps of 8 rows whose loads are issued together
    warps_per_sm: int = 12  # what the grid (its row groups) aims to keep resident


FWD_LAUNCH = LaunchKnobs("cutedsl mhc_coeff_fwd", ForwardLaunch())
BWD_LAUNCH = LaunchKnobs("cutedsl mhc_coeff_bwd", BackwardLaunch())


def _unsupported(x, phi, *args, hc, **kwargs):
    if not 1 <= hc <= MAX_HC:
        return f"hc={hc} is not supported (1 <= hc <= {MAX_HC})"
    if x.dim() == 2 and x.shape[1] % 2:
        return f"K = hc * C = {x.shape[1]} is odd (the MMA operands pair columns)"
    return None


MHC_CAPABILITY = capability(_unsupported)


def _tiles(n):
    """n8 MMA tiles covering n columns."""
    return cdiv(n, 8)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


class MixPartials:
    """Grid (row blocks of FWD_WARPS * 16, K splits), a warp per 16 rows, all walking the CTA's K range in blocks
    of 4 * cols columns: the partial x @ phi and sum(x^2) of each row go to mWs[split * M + row, :n] and [.., n].

    Thread (g, t) loads columns [col, col + cols) of rows g and g + 8, col = block start + cols * t, and of
    phi^T rows 8p + g; MMA k-step s takes columns col + 2s and col + 2s + 1 as its k indices t and t + 4.
    """

    def __init__(self, n, cols, x_mode, phi_mode, unroll):
        self.n, self.vec, self.unroll = n, cols, unroll
        self.x_mode, self.phi_mode = x_mode, phi_mode

    @cute.jit
    def __call__(self, mX: cute.Tensor, mPhiT: cute.Tensor, mWs: cute.Tensor, blocks_per_split: Int32,
                 n_splits: Int32, stream):
        self.kernel(mX, mPhiT, mWs, blocks_per_split).launch(
            grid=[cute.ceil_div(mX.shape[0], FWD_WARPS * MMA_ROWS), n_splits, 1], block=[32 * FWD_WARPS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mPhiT: cute.Tensor, mWs: cute.Tensor, blocks_per_split: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, split, _ = cute.arch.block_idx()
        lane, warp = tidx % 32, tidx // 32
        g, t = lane // 4, lane % 4
        n_rows, n_cols = mX.shape
        n, vec, tiles = self.n, self.vec, _tiles(self.n)
        mma = WarpMma.of(lane)
        rows = ((block * FWD_WARPS + warp) * MMA_ROWS + g, (block * FWD_WARPS + warp) * MMA_ROWS + g + 8)
        x_rows = [mX[cutlass.min(r, n_rows - 1), None] for r in rows]  # past the end: computed, not written
        phi_rows = [mPhiT[cutlass.min(8 * p + g, n - 1), None] for p in range(tiles)]
        acc = [mma.zeros() for _ in range(tiles)]
        sumsq0, sumsq1 = Float32(0.0), Float32(0.0)

        span = 4 * vec
        first = split * blocks_per_split
        last = cutlass.min(first + blocks_per_split, (n_cols + span - 1) // span)
        # `unroll` k-blocks a step: all their loads are issued before the first MMA
        for step in cutlass.range(first, last, self.unroll, unroll=1):
            loads = []
            for d in cutlass.range_constexpr(self.unroll):
                col = (step + d) * span + vec * t
                loads.append(([issue_chunk(r, col, vec, n_cols) for r in x_rows],
                              [issue_chunk(r, col, vec, n_cols) for r in phi_rows],
                              flag(step + d < last) * flag(col < n_cols)))
            for d in cutlass.range_constexpr(self.unroll):
                x_frags, phi_frags, keep = loads[d]
                xs = [chunk_values(f, keep) for f in x_frags]
                ps = [chunk_values(f, 1.0) for f in phi_frags]
                sumsq0 += dot(xs[0], xs[0])
                sumsq1 += dot(xs[1], xs[1])
                for s in cutlass.range_constexpr(vec // 2):
                    a = tf32_parts([xs[0][2 * s], xs[1][2 * s], xs[0][2 * s + 1], xs[1][2 * s + 1]], self.x_mode)
                    for p in cutlass.range_constexpr(tiles):
                        mma(acc[p], a, tf32_parts([ps[p][2 * s], ps[p][2 * s + 1]], self.phi_mode))

        for i in cutlass.range_constexpr(2):
            total = (sumsq0, sumsq1)[i]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            if rows[i] < n_rows:
                out = split * n_rows + rows[i]
                for p in cutlass.range_constexpr(tiles):
                    for e in cutlass.range_constexpr(2):
                        if 8 * p + 2 * t + e < n:
                            mWs[out, 8 * p + 2 * t + e] = acc[p][2 * i + e]
                if t == 0:
                    mWs[out, n] = total


class Epilogue:
    """One thread per row: the n_parts partials of MixPartials summed in order, then rstd, mix, the sigmoids
    and Sinkhorn, written to h_pre, h_post, h_res [M, hc * hc], mix and rstd."""

    def __init__(self, hc, tmax):
        self.hc, self.n, self.tmax = hc, columns(hc), tmax

    @cute.jit
    def __call__(self, mWs: cute.Tensor, n_parts: Int32, n_cols: Int32, mB: cute.Tensor, mApre: cute.Tensor,
                 mApost: cute.Tensor, mAres: cute.Tensor, mPre: cute.Tensor, mPost: cute.Tensor, mRes: cute.Tensor,
                 mMix: cute.Tensor, mRstd: cute.Tensor, rms_eps: Float32, pre_eps: Float32, sinkhorn_eps: Float32,
                 post_mult: Float32, stream):
        self.kernel(mWs, n_parts, n_cols, mB, mApre, mApost, mAres, mPre, mPost, mRes, mMix, mRstd, rms_eps,
                    pre_eps, sinkhorn_eps, post_mult).launch(
            grid=[cute.ceil_div(mRstd.shape[0], EPILOGUE_THREADS), 1, 1], block=[EPILOGUE_THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mWs: cute.Tensor, n_parts: Int32, n_cols: Int32, mB: cute.Tensor, mApre: cute.Tensor,
               mApost: cute.Tensor, mAres: cute.Tensor, mPre: cute.Tensor, mPost: cute.Tensor, mRes: cute.Tensor,
               mMix: cute.Tensor, mRstd: cute.Tensor, rms_eps: Float32, pre_eps: Float32, sinkhorn_eps: Float32,
               post_mult: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        hc, n = self.hc, self.n
        n_rows = mRstd.shape[0]
        row = block * EPILOGUE_THREADS + tidx
        if row < n_rows:
            total = cute.make_rmem_tensor(cute.make_layout(n + 1), Float32)
            total.fill(0.0)
            for part in cutlass.range(n_parts, unroll=1):
                vals = row_values(mWs, part * n_rows + row)
                for j in cutlass.range_constexpr(n + 1):
                    total[j] = total[j] + vals[j]
            rstd = cute.math.rsqrt(total[n] / Float32(n_cols) + rms_eps)
            mRstd[row] = rstd
            mix = [total[j] * rstd for j in range(n)]
            for j in cutlass.range_constexpr(n):
                mMix[row, j] = mix[j]
            a_pre, a_post, a_res = mApre[0], mApost[0], mAres[0]
            for i in cutlass.range_constexpr(hc):
                mPre[row, i] = sigmoid(mix[i] * a_pre + mB[i]) + pre_eps
                mPost[row, i] = sigmoid(mix[hc + i] * a_post + mB[hc + i]) * post_mult
            L = [[mix[2 * hc + r * hc + c] * a_res + mB[2 * hc + r * hc + c] for c in range(hc)] for r in range(hc)]
            _, P, _, _ = sinkhorn(L, self.tmax, sinkhorn_eps)
            for r in cutlass.range_constexpr(hc):
                for c in cutlass.range_constexpr(hc):
                    mRes[row, r * hc + c] = P[r][c]


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


class CoefficientBackward:
    """One thread per row: gz [M, 8 * tiles] (zero past n), coef [M], per-CTA partials [blocks, n + 3] of grad_b
    and the alphas. A missing upstream gradient (None) counts as zeros."""

    def __init__(self, hc, tmax, has_pre, has_post, has_res):
        self.hc, self.n, self.tmax = hc, columns(hc), tmax
        self.has = (has_pre, has_post, has_res)

    @cute.jit
    def __call__(self, mMix: cute.Tensor, mRstd: cute.Tensor, mB: cute.Tensor, mApre: cute.Tensor,
                 mApost: cute.Tensor, mAres: cute.Tensor, mGpre: cute.Tensor | None, mGpost: cute.Tensor | None,
                 mGres: cute.Tensor | None, mGz: cute.Tensor, mCoef: cute.Tensor, mPart: cute.Tensor, n_cols: Int32,
                 sinkhorn_eps: Float32, post_mult: Float32, stream):
        self.kernel(mMix, mRstd, mB, mApre, mApost, mAres, mGpre, mGpost, mGres, mGz, mCoef, mPart, n_cols,
                    sinkhorn_eps, post_mult).launch(
            grid=[cute.ceil_div(mMix.shape[0], PRODUCER_THREADS), 1, 1], block=[PRODUCER_THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mMix: cute.Tensor, mRstd: cute.Tensor, mB: cute.Tensor, mApre: cute.Tensor,
               mApost: cute.Tensor, mAres: cute.Tensor, mGpre: cute.Tensor | None, mGpost: cute.Tensor | None,
               mGres: cute.Tensor | None, mGz: cute.Tensor, mCoef: cute.Tensor, mPart: cute.Tensor, n_cols: Int32,
               sinkhorn_eps: Float32, post_mult: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        hc, n = self.hc, self.n
        has_pre, has_post, has_res = self.has
        n_rows = mMix.shape[0]
        row = block * PRODUCER_THREADS + tidx
        ok = row < n_rows
        src = cutlass.min(row, n_rows - 1)
        mix = row_values(mMix, src)
        rstd = mRstd[src]
        b = [mB[j] for j in range(n)]
        alphas = (mApre[0], mApost[0], mAres[0])

        # du: d loss / d (mix * alpha + b), segment by segment
        du = [Float32(0.0)] * n
        if cutlass.const_expr(has_pre):
            g = row_values(mGpre, src)
            for i in cutlass.range_constexpr(hc):
                s = sigmoid(mix[i] * alphas[0] + b[i])
                du[i] = g[i] * s * (1.0 - s)
        if cutlass.const_expr(has_post):
            g = row_values(mGpost, src)
            for i in cutlass.range_constexpr(hc):
                s = sigmoid(mix[hc + i] * alphas[1] + b[hc + i])
                du[hc + i] = g[i] * post_mult * s * (1.0 - s)
        if cutlass.const_expr(has_res):
            g = row_values(mGres, src)
            L = [[mix[2 * hc + r * hc + c] * alphas[2] + b[2 * hc + r * hc + c] for c in range(hc)]
                 for r in range(hc)]
            dL = sinkhorn_backward(*sinkhorn(L, self.tmax, sinkhorn_eps),
                                   [[g[r * hc + c] for c in range(hc)] for r in range(hc)])
            for r in cutlass.range_constexpr(hc):
                for c in cutlass.range_constexpr(hc):
                    du[2 * hc + r * hc + c] = dL[r][c]

        segment = [0] * hc + [1] * hc + [2] * (hc * hc)
        grad_mix = [du[j] * alphas[segment[j]] for j in range(n)]
        gz = [v * rstd for v in grad_mix] + [Float32(0.0)] * (8 * _tiles(n) - n)
        if ok:
            for j in cutlass.range_constexpr(len(gz)):
                mGz[row, j] = gz[j]
            mCoef[row] = rstd * rstd / Float32(n_cols) * dot(grad_mix, mix)

        keep = Float32(cutlass.select_(ok, Float32(1.0), Float32(0.0)))  # rows past the end add nothing
        seg_sums = [Float32(0.0)] * 3
        for j in cutlass.range_constexpr(n):
            seg_sums[segment[j]] = seg_sums[segment[j]] + du[j] * mix[j]
        buf = _row.reduction_buffer(PRODUCER_THREADS // 32, n + 3)
        sums = _row.block_sum(tuple(v * keep for v in du + seg_sums), buf, 0)
        if tidx == 0:
            for j in cutlass.range_constexpr(n + 3):
                mPart[block, j] = sums[j]


class MatmulBackward:
    """Grid (column blocks of MM_WARPS * 8 * vec, row groups); per warp 8 * vec columns of x over the group's rows,
    8 rows a step: grad_x = gz @ phi^T - coef * x and the group's grad_phi partial, to mWs[group * K + k, j].

    Thread (g, t) holds columns [col, col + vec), col = warp start + vec * g, of rows mb + t and mb + t + 4.
    MMA tile q takes columns col + 2q and col + 2q + 1 as its rows g and g + 8:
      grad_phi tile (q, p) += x^T @ gz: k indices t, t + 4 are rows mb + t, mb + t + 4; n = columns 8p + ...
      grad_x^T tile q = phi @ gz^T over k = j: its n indices 2t, 2t + 1 are rows mb + t, mb + t + 4, so the
      accumulator lands on the elements of x this thread holds.
    """

    def __init__(self, n, vec, x_mode, phi_mode, gz_mode, unroll):
        self.n, self.vec, self.unroll = n, vec, unroll
        self.x_mode, self.phi_mode, self.gz_mode = x_mode, phi_mode, gz_mode

    @cute.jit
    def __call__(self, mX: cute.Tensor, mPhi: cute.Tensor, mGz: cute.Tensor, mCoef: cute.Tensor, mGradX: cute.Tensor,
                 mWs: cute.Tensor, rows_per_group: Int32, n_groups: Int32, stream):
        self.kernel(mX, mPhi, mGz, mCoef, mGradX, mWs, rows_per_group).launch(
            grid=[cute.ceil_div(mX.shape[1], MM_WARPS * 8 * self.vec), n_groups, 1], block=[32 * MM_WARPS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mPhi: cute.Tensor, mGz: cute.Tensor, mCoef: cute.Tensor, mGradX: cute.Tensor,
               mWs: cute.Tensor, rows_per_group: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, group, _ = cute.arch.block_idx()
        lane, warp = tidx % 32, tidx // 32
        g, t = lane // 4, lane % 4
        n_rows, n_cols = mX.shape
        n, vec, tiles, quads = self.n, self.vec, _tiles(self.n), self.vec // 2
        mma = WarpMma.of(lane)
        col = ((block * MM_WARPS + warp) * 8 + g) * vec
        col_ok = col < n_cols
        src_col = cutlass.min(col, n_cols - vec)
        # grad_x^T's A operand, phi[column, j], the same for every row
        phi_a = [[tf32_parts([masked_at(mPhi, src_col + 2 * q + r, 8 * p + t + k, n) for k in (0, 4) for r in (0, 1)],
                             self.phi_mode) for p in range(tiles)] for q in range(quads)]
        acc = [[mma.zeros() for _ in range(tiles)] for _ in range(quads)]

        first = group * rows_per_group
        last = cutlass.min(first + rows_per_group, n_rows)
        # `unroll` steps of 8 rows at a time: all their loads are issued before the first MMA
        for step in cutlass.range(first, last, 8 * self.unroll, unroll=1):
            loads = []
            for d in cutlass.range_constexpr(self.unroll):
                mb = step + 8 * d
                rows = (mb + t, mb + t + 4)
                srcs = [cutlass.min(r, n_rows - 1) for r in rows]
                # B of grad_x^T: gz[row of n index g, j]; n = 2i + e is row mb + i + 4e
                row_g = cutlass.min(mb + g // 2 + 4 * (g % 2), n_rows - 1)
                loads.append((
                    rows, [issue_chunk(mX[r, None], col, vec, n_cols) for r in srcs],
                    [[mGz[srcs[0], 8 * p + g], mGz[srcs[1], 8 * p + g]] for p in range(tiles)],
                    [[mGz[row_g, 8 * p + t], mGz[row_g, 8 * p + t + 4]] for p in range(tiles)],
                    [mCoef[r] for r in srcs]))
            for d in cutlass.range_constexpr(self.unroll):
                rows, x_frags, gz_phi, gz_x, coef = loads[d]
                xs = [chunk_values(f, flag(r < last)) for f, r in zip(x_frags, rows)]
                for p in cutlass.range_constexpr(tiles):
                    gz_b = tf32_parts(gz_phi[p], self.gz_mode)
                    for q in cutlass.range_constexpr(quads):
                        mma(acc[q][p], tf32_parts([xs[0][2 * q], xs[0][2 * q + 1], xs[1][2 * q], xs[1][2 * q + 1]],
                                                  self.x_mode), gz_b)
                gz_x = [tf32_parts(v, self.gz_mode) for v in gz_x]
                out = [[], []]
                for q in cutlass.range_constexpr(quads):
                    c = mma.zeros()
                    for p in cutlass.range_constexpr(tiles):
                        mma(c, phi_a[q][p], gz_x[p])
                    for i in cutlass.range_constexpr(2):
                        out[i] += [c[i] - coef[i] * xs[i][2 * q], c[2 + i] - coef[i] * xs[i][2 * q + 1]]
                for i in cutlass.range_constexpr(2):
                    if col_ok:
                        if rows[i] < last:
                            dst = cute.local_tile(mGradX[rows[i], None], (vec,), (col // vec,))
                            frag = cute.make_rmem_tensor_like(dst)
                            for e in cutlass.range_constexpr(vec):
                                frag[e] = out[i][e].to(frag.element_type)
                            cute.autovec_copy(frag, dst)

        if col_ok:
            for q in cutlass.range_constexpr(quads):
                for p in cutlass.range_constexpr(tiles):
                    for e in cutlass.range_constexpr(4):
                        j = 8 * p + 2 * t + e % 2
                        if j < n:
                            mWs[group * n_cols + col + 2 * q + e // 2, j] = acc[q][p][e]


class Reduce:
    """grad_phi = the row groups' partials summed in order (flat [K * n]); in the last CTA, grad_b and the alphas =
    the producer's per-CTA partials [blocks, n + 3] summed in order."""

    @cute.jit
    def __call__(self, mWs: cute.Tensor, mGradPhi: cute.Tensor, mPart: cute.Tensor, mGradBA: cute.Tensor,
                 n_groups: Int32, stream):
        self.kernel(mWs, mGradPhi, mPart, mGradBA, n_groups).launch(
            grid=[cute.ceil_div(mGradPhi.shape[0], REDUCE_THREADS) + 1, 1, 1], block=[REDUCE_THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mWs: cute.Tensor, mGradPhi: cute.Tensor, mPart: cute.Tensor, mGradBA: cute.Tensor,
               n_groups: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        n_blocks, _, _ = cute.arch.grid_dim()
        size = mGradPhi.shape[0]
        if block < n_blocks - 1:
            i = block * REDUCE_THREADS + tidx
            if i < size:
                total = Float32(0.0)
                for grp in cutlass.range(n_groups, unroll=4):
                    total += mWs[grp * size + i]
                mGradPhi[i] = total.to(mGradPhi.element_type)
        elif tidx < mGradBA.shape[0]:
            total = Float32(0.0)
            for p in cutlass.range(mPart.shape[0], unroll=4):
                total += mPart[p, tidx]
            mGradBA[tidx] = total


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _fake(dtype, shape, stride, align):
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def _matrix(dtype, vec, rows=None):
    """[R, C], both symbolic (or R given), unit column stride, row stride a multiple of vec, vec-element aligned."""
    return _fake(dtype, (rows if rows is not None else cute.sym_int(), cute.sym_int()),
                 (cute.sym_int64(divisibility=vec), 1), vec * dtype.width // 8)


def _rows(n_cols, rows=None, dtype=cutlass.Float32):
    """[M, n_cols] contiguous, M symbolic (or given)."""
    return _fake(dtype, (rows if rows is not None else cute.sym_int(), n_cols), (n_cols, 1),
                 math.gcd(16, n_cols * dtype.width // 8))


def _vector(size=None, dtype=cutlass.Float32):
    return _fake(dtype, (size if size is not None else cute.sym_int(),), (1,), dtype.width // 8)


def _modes(x_dtype, phi_dtype):
    """TF32 operand modes of (x, phi, gz): 16-bit data is exact, fp32 is split; gz is rounded next to 16-bit data."""
    x_mode = EXACT if x_dtype.itemsize == 2 else SPLIT
    phi_mode = EXACT if phi_dtype.itemsize == 2 else SPLIT
    return x_mode, phi_mode, ROUNDED if x_mode == phi_mode == EXACT else SPLIT


@cache
def _mix_partials(x_dtype, phi_dtype, n, cols, align, unroll):
    """cols: columns a thread takes a row and k-block; align: the elements its loads may assume aligned."""
    x_mode, phi_mode, _ = _modes(x_dtype, phi_dtype)
    return Launcher(compile_kernel(MixPartials(n, cols, x_mode, phi_mode, unroll), _matrix(CUTE_DTYPE[x_dtype], align),
                                   _matrix(CUTE_DTYPE[phi_dtype], align, rows=n), _rows(n + 1), 0, 0))


@cache
def _epilogue(hc, tmax):
    n, rows = columns(hc), cute.sym_int()
    return Launcher(compile_kernel(
        Epilogue(hc, tmax), _rows(n + 1), 0, 0, _vector(n), _vector(1), _vector(1), _vector(1), _rows(hc, rows),
        _rows(hc, rows), _rows(hc * hc, rows), _rows(n, rows), _vector(rows), 0.0, 0.0, 0.0, 0.0))


@cache
def _coefficient_backward(hc, tmax, has_pre, has_post, has_res):
    n, rows = columns(hc), cute.sym_int()
    grads = [_rows(width, rows) if has else None for has, width in zip((has_pre, has_post, has_res), (hc, hc, hc * hc))]
    return Launcher(compile_kernel(
        CoefficientBackward(hc, tmax, has_pre, has_post, has_res), _rows(n, rows), _vector(rows), _vector(n),
        _vector(1), _vector(1), _vector(1), *grads, _rows(8 * _tiles(n), rows), _vector(rows), _rows(n + 3), 0, 0.0,
        0.0))


@cache
def _matmul_backward(x_dtype, phi_dtype, n, vec, unroll):
    x = CUTE_DTYPE[x_dtype]
    return Launcher(compile_kernel(
        MatmulBackward(n, vec, *_modes(x_dtype, phi_dtype), unroll), _matrix(x, vec),
        _rows(n, dtype=CUTE_DTYPE[phi_dtype]), _rows(8 * _tiles(n)), _vector(), _matrix(x, vec), _rows(n), 0, 0))


@cache
def _reduce(phi_dtype, n):
    return Launcher(compile_kernel(Reduce(), _vector(), _vector(dtype=CUTE_DTYPE[phi_dtype]), _rows(n + 3),
                                   _vector(n + 3), 0))


def forward_splits(M, K, vec, n_sms, warps_per_sm):
    """K splits of the forward: as many as keep the warps within warps_per_sm an SM, 4 k-blocks a split at least."""
    warps = cdiv(M, MMA_ROWS)
    k_blocks = cdiv(K, 4 * vec)
    return max(1, min(warps_per_sm * n_sms // warps, k_blocks // 4))


def forward_cols(K, align, most):
    """Columns a forward thread takes a row and k-block: up to `most`, whole aligned vectors, dividing K."""
    cols = max(most, align)
    while cols > align and K % cols:
        cols //= 2
    return cols


def matmul_groups(M, K, vec, n_sms, warps_per_sm):
    """(row groups, rows per group, a multiple of 8) of the MM/RMS backward: about warps_per_sm warps an SM."""
    col_blocks = cdiv(K, MM_WARPS * 8 * vec)
    wanted = max(1, min(cdiv(warps_per_sm * n_sms, col_blocks * MM_WARPS), cdiv(M, 8)))
    rows = cdiv(cdiv(M, wanted), 8) * 8
    return cdiv(M, rows), rows


def matmul_vec(K, n, max_vec, *rows):
    """Columns a thread of the MM/RMS backward takes: pick_vec up to max_vec, fewer while vec/2 x tiles(n) MMA
    tiles of phi and of the accumulators would crowd the registers."""
    vec = min(pick_vec(K, *rows), max_vec)
    while vec > 2 and vec // 2 * _tiles(n) > 12:
        vec //= 2
    return vec


def _operands(x, phi, b):
    """x with unit column stride and 2-element aligned rows (any row stride), phi and b contiguous."""
    if x.stride(1) != 1 or pick_vec(x.shape[1], x) < 2:
        x = x.clone(memory_format=torch.contiguous_format)
    return x, *contiguous(phi, b)


def _alphas(*alphas):
    return tuple(a.reshape(1) for a in alphas)


@register_backend("mhc_coeff_fwd", backend="cutedsl", priority=MHC_PRIORITY, capability=MHC_CAPABILITY)
def mhc_coeff_fwd(x, phi, b, alpha_pre, alpha_post, alpha_res, *, hc, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                  sinkhorn_eps=1e-6, post_mult=2.0):
    launch = FWD_LAUNCH.current
    x, phi, b = _operands(x, phi, b)
    M, K = x.shape
    n, dev = columns(hc), x.device
    pre, post, res, mix, rstd = forward_outputs(M, hc, dev)
    if M == 0:
        return pre, post, res, mix, rstd
    phi_t = phi.t().contiguous()
    align = pick_vec(K, x, phi_t)
    cols = forward_cols(K, align, launch.cols)
    splits = forward_splits(M, K, cols, sm_count(dev), launch.warps_per_sm)
    blocks_per_split = cdiv(cdiv(K, 4 * cols), splits)
    ws = torch.empty(splits * M, n + 1, device=dev, dtype=_F32)
    _mix_partials(x.dtype, phi.dtype, n, cols, align, launch.unroll)(x, phi_t, ws, blocks_per_split, splits)
    _epilogue(hc, tmax)(ws, splits, K, b, *_alphas(alpha_pre, alpha_post, alpha_res), pre, post,
                        res.view(M, hc * hc), mix, rstd, float(rms_eps), float(pre_eps), float(sinkhorn_eps),
                        float(post_mult))
    return pre, post, res, mix, rstd


def _grad(g, shape):
    """An upstream gradient as the producer takes it: fp32, [M, width], contiguous; no op when it already is."""
    if g is None:
        return None
    if g.dtype != _F32:
        g = g.to(_F32)
    if g.shape != shape:
        g = g.reshape(shape)
    return g if g.is_contiguous() else g.contiguous()


@register_backend("mhc_coeff_bwd", backend="cutedsl", priority=MHC_PRIORITY, capability=MHC_CAPABILITY)
def mhc_coeff_bwd(x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd, grad_h_pre, grad_h_post, grad_h_res, *,
                  hc, tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0):
    launch = BWD_LAUNCH.current
    x, phi, b = _operands(x, phi, b)
    M, K = x.shape
    n, dev = columns(hc), x.device
    grad_x, grad_phi, grad_b_alpha, results = backward_results(x, phi, n)
    if M == 0:
        return results
    grads = (_grad(grad_h_pre, (M, hc)), _grad(grad_h_post, (M, hc)), _grad(grad_h_res, (M, hc * hc)))
    gz = torch.empty(M, 8 * _tiles(n), device=dev, dtype=_F32)
    coef = torch.empty(M, device=dev, dtype=_F32)
    part = torch.empty(cdiv(M, PRODUCER_THREADS), n + 3, device=dev, dtype=_F32)
    _coefficient_backward(hc, tmax, *(g is not None for g in grads))(
        *contiguous(mix, rstd), b, *_alphas(alpha_pre, alpha_post, alpha_res), *grads, gz, coef, part, K,
        float(sinkhorn_eps), float(post_mult))

    vec = matmul_vec(K, n, launch.max_vec, x, grad_x)
    groups, rows_per_group = matmul_groups(M, K, vec, sm_count(dev), launch.warps_per_sm)
    ws = torch.empty(groups * K, n, device=dev, dtype=_F32)
    _matmul_backward(x.dtype, phi.dtype, n, vec, launch.unroll)(x, phi, gz, coef, grad_x, ws, rows_per_group, groups)
    _reduce(phi.dtype, n)(ws.view(-1), grad_phi.view(-1), part, grad_b_alpha, groups)
    return results
