"""mHC coefficients in CuTeDSL, on the FMA units: a one-launch forward and a three-launch backward.

x @ phi has only n = hc*hc + 2*hc columns (24 at hc = 4), so every kernel keeps a whole row of the small
side in registers and streams x once:
  forward: one lane per row of x, the CTA's warps split K; each lane accumulates x[row, k] * phi[k, :]
      (phi rows are the same address across the warp: one broadcast load) and sum(x^2). The warps'
      partials meet in shared memory in a fixed order; warp 0 then runs rstd, the sigmoids and the
      Sinkhorn iterations for its 32 rows in registers. When the rows alone cannot fill the GPU, K is
      also split across CTAs and a second launch merges the partials and runs the same epilogue.
  backward, three launches:
    1. coefficient producer, one thread per row: sigmoid derivatives and the Sinkhorn backward (the
       iterates are rebuilt in reverse from the saved row and column denominators), gz = grad_mix * rstd,
       the RMS coefficient rstd^2 / K * sum_j(grad_mix_j * mix_j), per-CTA partial sums for grad_b and
       the alphas;
    2. MM/RMS backward, one thread per pair of k: grad_x[m, k] = gz[m, :] . phi[k, :] - coef[m] * x[m, k]
       and, over a group of rows, grad_phi[k, :] += x[m, k] * gz[m, :];
    3. reducer: grad_phi over the row groups, grad_b and the alphas over the producer's CTAs.
Every reduction runs in a fixed order; there are no atomics.

Registered after Triton: Triton's tensor-core x @ phi is faster at training shapes (benchmarks/NOTES.md),
so auto mode picks this one on Hopper only where Triton cannot serve (hc = 3, say), ahead of Helion.
"""

import math

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from liger_dispatch import register_backend

from . import _row
from ._row import LOG2E
from ._support import CUTE_DTYPE, Launcher, cache, capability, compile_kernel, pick_vec

MHC_PRIORITY = 25  # after triton (20), before helion (30): see the module docstring
MAX_HC = 8
LANES = 32  # rows of a forward / epilogue CTA: one per lane
FORWARD_WARPS = 8  # the warps of a forward CTA split its K range
PRODUCER_THREADS = 128
MM_THREADS = 256
REDUCE_THREADS = 256
_F32 = torch.float32


def _unsupported(x, phi, *args, hc, **kwargs):
    if not 1 <= hc <= MAX_HC:
        return f"hc={hc} is not supported (1 <= hc <= {MAX_HC})"
    return None


MHC_CAPABILITY = capability(_unsupported)


def _n(hc):
    return hc * hc + 2 * hc


# ----------------------------------------------------------------------------------------------
# Per-row math on Python lists of fp32 scalars (traced inline, fully unrolled)
# ----------------------------------------------------------------------------------------------


def _sigmoid(u):
    return 1.0 / (1.0 + cute.math.exp2(-u * LOG2E, fastmath=True))


def _softmax_rows(L):
    out = []
    for row in L:
        m = row[0]
        for v in row[1:]:
            m = cute.arch.fmax(m, v)
        e = [cute.math.exp2((v - m) * LOG2E, fastmath=True) for v in row]
        inv = 1.0 / sum(e[1:], e[0])
        out.append([v * inv for v in e])
    return out


def _normalize_columns(A, eps):
    """A / (column sums + eps), and the denominators."""
    den = [sum((row[c] for row in A[1:]), A[0][c]) + eps for c in range(len(A[0]))]
    inv = [1.0 / d for d in den]
    return [[v * inv[c] for c, v in enumerate(row)] for row in A], den


def _normalize_rows(A, eps):
    den = [sum(row[1:], row[0]) + eps for row in A]
    return [[v * (1.0 / d) for v in row] for row, d in zip(A, den)], den


def sinkhorn(L, tmax, eps):
    """(softmax S, result P, row denominators of rounds 1.., column denominators of rounds 0..)."""
    S = _softmax_rows(L)
    P, col_den = _normalize_columns([[s + eps for s in row] for row in S], eps)
    row_dens, col_dens = [], [col_den]
    for _ in range(1, tmax):
        R, row_den = _normalize_rows(P, eps)
        P, col_den = _normalize_columns(R, eps)
        row_dens.append(row_den)
        col_dens.append(col_den)
    return S, P, row_dens, col_dens


def _column_step_backward(G, P, den):
    """Through P = A / (colsum(A) + eps): dA[r][c] = (G[r][c] - sum_r' G[r'][c] P[r'][c]) / den[c]."""
    hc = len(G)
    dot = [sum((G[r][c] * P[r][c] for r in range(1, hc)), G[0][c] * P[0][c]) for c in range(hc)]
    inv = [1.0 / d for d in den]
    return [[(G[r][c] - dot[c]) * inv[c] for c in range(hc)] for r in range(hc)]


def _row_step_backward(G, P, den):
    hc = len(G)
    dot = [sum((G[r][c] * P[r][c] for c in range(1, hc)), G[r][0] * P[r][0]) for r in range(hc)]
    return [[(G[r][c] - dot[r]) * (1.0 / den[r]) for c in range(hc)] for r in range(hc)]


def sinkhorn_backward(S, P, row_dens, col_dens, G):
    """dL/dlogits from dL/dP. Each round's input is rebuilt from its output times its denominators."""
    for t in range(len(row_dens), 0, -1):
        G = _column_step_backward(G, P, col_dens[t])
        P = [[v * col_dens[t][c] for c, v in enumerate(row)] for row in P]
        G = _row_step_backward(G, P, row_dens[t - 1])
        P = [[v * d for v in row] for row, d in zip(P, row_dens[t - 1])]
    G = _column_step_backward(G, P, col_dens[0])
    # through S = softmax(L) (the + eps has no derivative): dL = S * (G - sum_c' G S)
    hc = len(G)
    dot = [sum((G[r][c] * S[r][c] for c in range(1, hc)), G[r][0] * S[r][0]) for r in range(hc)]
    return [[S[r][c] * (G[r][c] - dot[r]) for c in range(hc)] for r in range(hc)]


def _load_row(t, row):
    """Row `row` of a matrix with a static column count, as fp32 values (one vectorized load)."""
    src = t[row, None]
    frag = cute.make_rmem_tensor_like(src)
    cute.autovec_copy(src, frag)
    vals = frag.load().to(Float32)
    return [vals[j] for j in range(cute.size(src))]


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


class _Coefficients:
    """The forward epilogue of one row: rstd, mix, the sigmoids and Sinkhorn, written to the outputs."""

    def __init__(self, hc, tmax):
        self.hc = hc
        self.tmax = tmax

    def __call__(self, row, acc, sumsq, n_cols, params, outputs, rms_eps, pre_eps, sinkhorn_eps, post_mult):
        hc = self.hc
        mB, mApre, mApost, mAres = params
        mPre, mPost, mRes, mMix, mRstd = outputs
        rstd = cute.math.rsqrt(sumsq / Float32(n_cols) + rms_eps)
        mRstd[row] = rstd
        mix = [a * rstd for a in acc]
        for j in range(len(mix)):
            mMix[row, j] = mix[j]
        a_pre, a_post, a_res = mApre[0], mApost[0], mAres[0]
        for i in range(hc):
            mPre[row, i] = _sigmoid(mix[i] * a_pre + mB[i]) + pre_eps
            mPost[row, i] = _sigmoid(mix[hc + i] * a_post + mB[hc + i]) * post_mult
        L = [[mix[2 * hc + r * hc + c] * a_res + mB[2 * hc + r * hc + c] for c in range(hc)] for r in range(hc)]
        _, P, _, _ = sinkhorn(L, self.tmax, sinkhorn_eps)
        for r in range(hc):
            for c in range(hc):
                mRes[row, r * hc + c] = P[r][c]


class MixForward:
    """Grid (row blocks of 32, K splits). split == 1: the whole forward; else partials to mWs [split * M, n + 1]."""

    def __init__(self, hc, tmax, vec, warps, split):
        self.hc, self.n = hc, _n(hc)
        self.vec = vec
        self.warps = warps
        self.split = split
        self.epilogue = _Coefficients(hc, tmax)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mPhi: cute.Tensor, params: tuple, outputs: tuple, mWs: cute.Tensor | None,
                 k_per_split: Int32, rms_eps: Float32, pre_eps: Float32, sinkhorn_eps: Float32, post_mult: Float32,
                 stream):
        self.kernel(mX, mPhi, params, outputs, mWs, k_per_split, rms_eps, pre_eps, sinkhorn_eps, post_mult).launch(
            grid=[cute.ceil_div(mX.shape[0], LANES), self.split, 1], block=[LANES * self.warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mPhi: cute.Tensor, params: tuple, outputs: tuple, mWs: cute.Tensor | None,
               k_per_split: Int32, rms_eps: Float32, pre_eps: Float32, sinkhorn_eps: Float32, post_mult: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        block, split, _ = cute.arch.block_idx()
        lane, warp = tidx % LANES, tidx // LANES
        n_rows, n_cols = mX.shape
        n, vec = self.n, self.vec
        row = block * LANES + lane
        x_row = mX[cutlass.min(row, n_rows - 1), None]  # rows past the end compute on the last row, unwritten

        acc = cute.make_rmem_tensor(cute.make_layout(n), Float32)
        acc.fill(0.0)
        sumsq = Float32(0.0)
        first = split * (k_per_split // vec)
        last = cutlass.min(first + k_per_split // vec, n_cols // vec)
        for chunk in cutlass.range(first + warp, last, self.warps, unroll=2):
            src = cute.local_tile(x_row, (vec,), (chunk,))
            frag = cute.make_rmem_tensor_like(src)
            cute.autovec_copy(src, frag)
            xv = frag.load().to(Float32)
            sumsq += _row.tile_sum(xv * xv)
            for kk in cutlass.range_constexpr(vec):
                phi_k = _load_row(mPhi, chunk * vec + kk)
                for j in cutlass.range_constexpr(n):
                    acc[j] = acc[j] + xv[kk] * phi_k[j]

        smem = cutlass.memory.SmemAllocator()
        buf = smem.allocate_tensor(Float32, cute.make_layout((LANES, n + 1, self.warps)), byte_alignment=16)
        for j in cutlass.range_constexpr(n):
            buf[lane, j, warp] = acc[j]
        buf[lane, n, warp] = sumsq
        cute.arch.barrier()
        if warp == 0:
            total = [buf[lane, j, 0] for j in range(n + 1)]
            for w in cutlass.range_constexpr(1, self.warps):
                total = [total[j] + buf[lane, j, w] for j in range(n + 1)]
            if row < n_rows:
                if const_expr(self.split == 1):
                    self.epilogue(row, total[:n], total[n], n_cols, params, outputs, rms_eps, pre_eps, sinkhorn_eps,
                                  post_mult)
                else:
                    for j in cutlass.range_constexpr(n + 1):
                        mWs[split * n_rows + row, j] = total[j]


class SplitEpilogue:
    """Merges the K-split partials of MixForward in split order, then the forward epilogue; one lane per row."""

    def __init__(self, hc, tmax, split):
        self.n = _n(hc)
        self.split = split
        self.epilogue = _Coefficients(hc, tmax)

    @cute.jit
    def __call__(self, mWs: cute.Tensor, n_cols: Int32, params: tuple, outputs: tuple, rms_eps: Float32,
                 pre_eps: Float32, sinkhorn_eps: Float32, post_mult: Float32, stream):
        n_rows = outputs[4].shape[0]
        self.kernel(mWs, n_cols, params, outputs, rms_eps, pre_eps, sinkhorn_eps, post_mult).launch(
            grid=[cute.ceil_div(n_rows, LANES), 1, 1], block=[LANES, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mWs: cute.Tensor, n_cols: Int32, params: tuple, outputs: tuple, rms_eps: Float32,
               pre_eps: Float32, sinkhorn_eps: Float32, post_mult: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        n_rows = outputs[4].shape[0]
        row = block * LANES + tidx
        if row < n_rows:
            total = _load_row(mWs, row)
            for s in cutlass.range_constexpr(1, self.split):
                part = _load_row(mWs, s * n_rows + row)
                total = [a + b for a, b in zip(total, part)]
            self.epilogue(row, total[:self.n], total[self.n], n_cols, params, outputs, rms_eps, pre_eps,
                          sinkhorn_eps, post_mult)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


class CoefficientBackward:
    """One thread per row: gz [M, n], coef [M] and per-CTA partials [blocks, n + 3] of grad_b and the alphas."""

    def __init__(self, hc, tmax, has_pre, has_post, has_res):
        self.hc, self.n = hc, _n(hc)
        self.tmax = tmax
        self.has = (has_pre, has_post, has_res)

    @cute.jit
    def __call__(self, mMix: cute.Tensor, mRstd: cute.Tensor, params: tuple, grads: tuple, mGz: cute.Tensor,
                 mCoef: cute.Tensor, mPart: cute.Tensor, n_cols: Int32, sinkhorn_eps: Float32, post_mult: Float32,
                 stream):
        self.kernel(mMix, mRstd, params, grads, mGz, mCoef, mPart, n_cols, sinkhorn_eps, post_mult).launch(
            grid=[cute.ceil_div(mMix.shape[0], PRODUCER_THREADS), 1, 1], block=[PRODUCER_THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mMix: cute.Tensor, mRstd: cute.Tensor, params: tuple, grads: tuple, mGz: cute.Tensor,
               mCoef: cute.Tensor, mPart: cute.Tensor, n_cols: Int32, sinkhorn_eps: Float32, post_mult: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        hc, n = self.hc, self.n
        mB, mApre, mApost, mAres = params
        mGpre, mGpost, mGres = grads
        has_pre, has_post, has_res = self.has
        n_rows = mMix.shape[0]
        row = block * PRODUCER_THREADS + tidx
        ok = row < n_rows
        src = cutlass.min(row, n_rows - 1)
        mix = _load_row(mMix, src)
        rstd = mRstd[src]
        b = [mB[j] for j in range(n)]
        alphas = (mApre[0], mApost[0], mAres[0])

        # du: d loss / d (mix * alpha + b), segment by segment
        du = [Float32(0.0)] * n
        if const_expr(has_pre):
            g = _load_row(mGpre, src)
            for i in cutlass.range_constexpr(hc):
                s = _sigmoid(mix[i] * alphas[0] + b[i])
                du[i] = g[i] * s * (1.0 - s)
        if const_expr(has_post):
            g = _load_row(mGpost, src)
            for i in cutlass.range_constexpr(hc):
                s = _sigmoid(mix[hc + i] * alphas[1] + b[hc + i])
                du[hc + i] = g[i] * post_mult * s * (1.0 - s)
        if const_expr(has_res):
            g = _load_row(mGres, src)
            L = [[mix[2 * hc + r * hc + c] * alphas[2] + b[2 * hc + r * hc + c] for c in range(hc)]
                 for r in range(hc)]
            dL = sinkhorn_backward(*sinkhorn(L, self.tmax, sinkhorn_eps),
                                   [[g[r * hc + c] for c in range(hc)] for r in range(hc)])
            for r in cutlass.range_constexpr(hc):
                for c in cutlass.range_constexpr(hc):
                    du[2 * hc + r * hc + c] = dL[r][c]

        segment = [0] * hc + [1] * hc + [2] * (hc * hc)
        grad_mix = [du[j] * alphas[segment[j]] for j in range(n)]
        if ok:
            for j in cutlass.range_constexpr(n):
                mGz[row, j] = grad_mix[j] * rstd
            mCoef[row] = rstd * rstd / Float32(n_cols) * sum(
                (grad_mix[j] * mix[j] for j in range(1, n)), grad_mix[0] * mix[0])

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
    """Grid (K blocks of MM_THREADS * kv columns, row groups): grad_x, and grad_phi partials [groups * K, n]."""

    def __init__(self, hc, kv):
        self.n = _n(hc)
        self.kv = kv

    @cute.jit
    def __call__(self, mX: cute.Tensor, mPhi: cute.Tensor, mGz: cute.Tensor, mCoef: cute.Tensor, mGradX: cute.Tensor,
                 mWs: cute.Tensor, rows_per_group: Int32, n_groups: Int32, stream):
        self.kernel(mX, mPhi, mGz, mCoef, mGradX, mWs, rows_per_group).launch(
            grid=[cute.ceil_div(mX.shape[1], MM_THREADS * self.kv), n_groups, 1], block=[MM_THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mPhi: cute.Tensor, mGz: cute.Tensor, mCoef: cute.Tensor, mGradX: cute.Tensor,
               mWs: cute.Tensor, rows_per_group: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, group, _ = cute.arch.block_idx()
        n, kv = self.n, self.kv
        n_rows, n_cols = mX.shape
        chunk = block * MM_THREADS + tidx
        ok = chunk < n_cols // kv
        chunk = cutlass.min(chunk, n_cols // kv - 1)
        phi = [_load_row(mPhi, chunk * kv + i) for i in range(kv)]
        acc = cute.make_rmem_tensor(cute.make_layout((kv, n)), Float32)
        acc.fill(0.0)
        first = group * rows_per_group
        for m in cutlass.range(first, cutlass.min(first + rows_per_group, n_rows), unroll=2):
            gz = _load_row(mGz, m)
            coef = mCoef[m]
            src = cute.local_tile(mX[m, None], (kv,), (chunk,))
            frag = cute.make_rmem_tensor_like(src)
            cute.autovec_copy(src, frag)
            xv = frag.load().to(Float32)
            out = cute.make_rmem_tensor_like(frag)
            for i in cutlass.range_constexpr(kv):
                dot = sum((gz[j] * phi[i][j] for j in range(1, n)), gz[0] * phi[i][0])
                out[i] = (dot - coef * xv[i]).to(out.element_type)
                for j in cutlass.range_constexpr(n):
                    acc[i, j] = acc[i, j] + xv[i] * gz[j]
            if ok:
                cute.autovec_copy(out, cute.local_tile(mGradX[m, None], (kv,), (chunk,)))
        if ok:
            for i in cutlass.range_constexpr(kv):
                for j in cutlass.range_constexpr(n):
                    mWs[group * n_cols + chunk * kv + i, j] = acc[i, j]


class Reduce:
    """grad_phi = sum over row groups of the partials (flat [K * n]), and, in the last CTA, grad_b and the
    alphas = sum over the producer's CTAs of its partials [blocks, n + 3]."""

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
                for g in cutlass.range(n_groups, unroll=4):
                    total += mWs[g * size + i]
                mGradPhi[i] = total.to(mGradPhi.element_type)
        elif tidx < mGradBA.shape[0]:
            total = Float32(0.0)
            for p in cutlass.range(mPart.shape[0], unroll=4):
                total += mPart[p, tidx]
            mGradBA[tidx] = total


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def _fake(dtype, shape, stride, align=16):
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def _rows(n_cols, rows=None, dtype=cutlass.Float32):
    """[M, n_cols] contiguous fp32 (or `dtype`) with M symbolic (or the given symbol)."""
    return _fake(dtype, (rows if rows is not None else cute.sym_int(), n_cols), (n_cols, 1),
                 align=math.gcd(16, n_cols * dtype.width // 8))


def _scalar():
    return _fake(cutlass.Float32, (1,), (1,), align=4)


def _params(n):
    return (_fake(cutlass.Float32, (n,), (1,), align=4), _scalar(), _scalar(), _scalar())


def _outputs(hc):
    rows = cute.sym_int()
    return (_rows(hc, rows), _rows(hc, rows), _rows(hc * hc, rows), _rows(_n(hc), rows),
            _fake(cutlass.Float32, (rows,), (1,), align=4))


def _x_matrix(dtype, vec):
    return _fake(CUTE_DTYPE[dtype], (cute.sym_int(), cute.sym_int()), (cute.sym_int64(divisibility=vec), 1),
                 align=vec * dtype.itemsize)


def _phi_matrix(dtype, hc):
    return _rows(_n(hc), dtype=CUTE_DTYPE[dtype])


@cache
def _forward(x_dtype, phi_dtype, hc, tmax, vec, warps, split):
    ws = _rows(_n(hc) + 1) if split > 1 else None
    return Launcher(compile_kernel(MixForward(hc, tmax, vec, warps, split), _x_matrix(x_dtype, vec),
                                   _phi_matrix(phi_dtype, hc), _params(_n(hc)), _outputs(hc), ws, 0, 0.0, 0.0, 0.0,
                                   0.0))


@cache
def _split_epilogue(hc, tmax, split):
    return Launcher(compile_kernel(SplitEpilogue(hc, tmax, split), _rows(_n(hc) + 1), 0, _params(_n(hc)),
                                   _outputs(hc), 0.0, 0.0, 0.0, 0.0))


@cache
def _coefficient_backward(hc, tmax, has_pre, has_post, has_res):
    n = _n(hc)
    rows = cute.sym_int()
    grads = tuple(_rows(w, rows) if has else None for has, w in zip((has_pre, has_post, has_res), (hc, hc, hc * hc)))
    return Launcher(compile_kernel(CoefficientBackward(hc, tmax, has_pre, has_post, has_res), _rows(n, rows),
                                   _fake(cutlass.Float32, (rows,), (1,), align=4), _params(n), grads, _rows(n, rows),
                                   _fake(cutlass.Float32, (rows,), (1,), align=4), _rows(n + 3), 0, 0.0, 0.0))


@cache
def _matmul_backward(x_dtype, phi_dtype, hc, kv):
    x = _x_matrix(x_dtype, kv)
    grad_x = _x_matrix(x_dtype, kv)
    return Launcher(compile_kernel(MatmulBackward(hc, kv), x, _phi_matrix(phi_dtype, hc), _rows(_n(hc)),
                                   _fake(cutlass.Float32, (cute.sym_int(),), (1,), align=4), grad_x, _rows(_n(hc)),
                                   0, 0))


@cache
def _reduce(phi_dtype, n):
    flat = cute.sym_int()
    return Launcher(compile_kernel(Reduce(), _fake(cutlass.Float32, (cute.sym_int(),), (1,), align=4),
                                   _fake(CUTE_DTYPE[phi_dtype], (flat,), (1,), align=2), _rows(n + 3),
                                   _fake(cutlass.Float32, (n + 3,), (1,), align=4), 0))


def _num_sms(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def forward_split(M, K, vec, n_sms):
    """K splits of the forward: 1 when the row blocks fill the GPU, else enough to give ~2 CTAs per SM."""
    blocks = -(-M // LANES)
    if blocks >= n_sms:
        return 1
    return max(1, min(-(-2 * n_sms // blocks), K // (vec * FORWARD_WARPS), 16))


def matmul_groups(M, K, kv, n_sms):
    """Row groups of the MM/RMS backward: ~4 CTAs per SM in all, at least 32 rows per group."""
    k_blocks = -(-K // (MM_THREADS * kv))
    groups = max(1, min(-(-4 * n_sms // k_blocks), -(-M // 32)))
    rows = -(-M // groups)
    return -(-M // rows), rows



def _operands(x, phi, b):
    """x with unit column stride (any row stride), phi and b contiguous; 0-d scalars as [1] views."""
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, phi.contiguous(), b.contiguous()


def _one(t):
    return t.reshape(1)


def _kv(x):
    """k columns per thread in the MM/RMS backward: 4 bytes of x (2 in 16-bit dtypes), if alignment allows."""
    return pick_vec(x.shape[1], x) if x.element_size() == 4 else min(2, pick_vec(x.shape[1], x))


@register_backend("mhc_coeff_fwd", backend="cutedsl", priority=MHC_PRIORITY, capability=MHC_CAPABILITY)
def mhc_coeff_fwd(x, phi, b, alpha_pre, alpha_post, alpha_res, *, hc, tmax=20, rms_eps=1e-6, pre_eps=0.0,
                  sinkhorn_eps=1e-6, post_mult=2.0):
    x, phi, b = _operands(x, phi, b)
    M, K = x.shape
    n, dev = _n(hc), x.device
    pre, post = torch.empty(M, hc, device=dev, dtype=_F32), torch.empty(M, hc, device=dev, dtype=_F32)
    res = torch.empty(M, hc, hc, device=dev, dtype=_F32)
    mix, rstd = torch.empty(M, n, device=dev, dtype=_F32), torch.empty(M, device=dev, dtype=_F32)
    if M == 0:
        return pre, post, res, mix, rstd
    vec = pick_vec(K, x)
    split = forward_split(M, K, vec, _num_sms(dev))
    k_per_split = -(-K // (vec * split)) * vec
    params = (b, _one(alpha_pre), _one(alpha_post), _one(alpha_res))
    outputs = (pre, post, res.view(M, hc * hc), mix, rstd)
    scalars = (float(rms_eps), float(pre_eps), float(sinkhorn_eps), float(post_mult))
    ws = torch.empty(split * M, n + 1, device=dev, dtype=_F32) if split > 1 else None
    _forward(x.dtype, phi.dtype, hc, tmax, vec, FORWARD_WARPS, split)(x, phi, params, outputs, ws, k_per_split,
                                                                      *scalars)
    if split > 1:
        _split_epilogue(hc, tmax, split)(ws, K, params, outputs, *scalars)
    return pre, post, res, mix, rstd


def _grad(g, shape):
    return None if g is None else g.to(_F32).reshape(shape).contiguous()


@register_backend("mhc_coeff_bwd", backend="cutedsl", priority=MHC_PRIORITY, capability=MHC_CAPABILITY)
def mhc_coeff_bwd(x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd, grad_h_pre, grad_h_post, grad_h_res, *,
                  hc, tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0):
    x, phi, b = _operands(x, phi, b)
    M, K = x.shape
    n, dev = _n(hc), x.device
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    grad_phi = torch.empty(K, n, device=dev, dtype=phi.dtype)
    grad_b_alpha = torch.empty(n + 3, device=dev, dtype=_F32)
    results = (grad_x, grad_phi, grad_b_alpha[:n], grad_b_alpha[n], grad_b_alpha[n + 1], grad_b_alpha[n + 2])
    if M == 0:
        grad_phi.zero_()
        grad_b_alpha.zero_()
        return results
    grads = (_grad(grad_h_pre, (M, hc)), _grad(grad_h_post, (M, hc)), _grad(grad_h_res, (M, hc * hc)))
    params = (b, _one(alpha_pre), _one(alpha_post), _one(alpha_res))
    gz = torch.empty(M, n, device=dev, dtype=_F32)
    coef = torch.empty(M, device=dev, dtype=_F32)
    part = torch.empty(-(-M // PRODUCER_THREADS), n + 3, device=dev, dtype=_F32)
    _coefficient_backward(hc, tmax, *(g is not None for g in grads))(
        mix.contiguous(), rstd.contiguous(), params, grads, gz, coef, part, K, float(sinkhorn_eps), float(post_mult))

    kv = _kv(x)
    groups, rows_per_group = matmul_groups(M, K, kv, _num_sms(dev))
    ws = torch.empty(groups * K, n, device=dev, dtype=_F32)
    _matmul_backward(x.dtype, phi.dtype, hc, kv)(x, phi, gz, coef, grad_x, ws, rows_per_group, groups)
    _reduce(phi.dtype, n)(ws.view(-1), grad_phi.view(-1), part, grad_b_alpha, groups)
    return results

