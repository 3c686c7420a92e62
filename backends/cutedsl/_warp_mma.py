"""Warp-level TF32 MMAs on hand-filled fragments, and the loads that feed them, for the CuTeDSL kernels.

The fragments are filled from registers in PTX order, so a kernel chooses which elements of its data each
fragment slot holds: a reduction index may be permuted freely as long as both operands agree.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, TFloat32

EXACT, ROUNDED, SPLIT = 0, 1, 2  # how fp32 values become TF32 MMA operands


def _tf32(v):
    """v rounded to the nearest TF32 value (an fp32 value whose low 13 mantissa bits are clear)."""
    return Int32(cute.arch.cvt_f32_tf32(v)).bitcast(Float32)


def tf32_parts(values, mode):
    """The TF32 terms whose sum is `values`: the values themselves (exact), their rounding, or rounding + rest."""
    if mode == EXACT:
        return [values]
    high = [_tf32(v) for v in values]
    if mode == ROUNDED:
        return [high]
    return [high, [v - h for v, h in zip(values, high)]]


@dataclass(frozen=True)
class WarpMma:
    """m16n8k8 TF32 MMA of one warp, C += A @ B, on fragments listed in PTX register order (lane = 4 g + t):
    A: [A[g, t], A[g+8, t], A[g, t+4], A[g+8, t+4]]; B: [B[t, g], B[t+4, g]];
    C: [C[g, 2t], C[g, 2t+1], C[g+8, 2t], C[g+8, 2t+1]].
    Operands come as tf32_parts lists; the low x low product of two split operands is dropped (2^-22).
    Frozen, so that the DSL treats its use inside a run-time loop as a read."""

    mma: cute.TiledMma
    a_shape: object
    b_shape: object
    c_shape: object

    @staticmethod
    def of(lane):
        mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaTF32Op((16, 8, 8)))
        thr = mma.get_slice(lane)
        return WarpMma(mma, thr.partition_shape_A((16, 8)), thr.partition_shape_B((8, 8)),
                       thr.partition_shape_C((16, 8)))

    def zeros(self):
        acc = cute.make_rmem_tensor(self.c_shape, Float32)
        acc.fill(0.0)
        return acc

    def _fragment(self, shape, values):
        frag = cute.make_rmem_tensor(shape, TFloat32)
        for i, v in enumerate(values):
            frag[i] = v.to(TFloat32)
        return frag

    def __call__(self, acc, a_parts, b_parts):
        for i, a in enumerate(a_parts):
            for j, b in enumerate(b_parts):
                if i + j < 2:
                    cute.gemm(self.mma, acc, self._fragment(self.a_shape, a), self._fragment(self.b_shape, b), acc)


def issue_chunk(row, col, vec, n_cols):
    """Starts loading `vec` elements of a row from `col` (a multiple of vec, clamped into the row). The values
    are read from the returned fragment only when needed (chunk_values), so loads issued together overlap."""
    src = cute.local_tile(row, (vec,), (cutlass.min(col, n_cols - vec) // vec,))
    frag = cute.make_rmem_tensor_like(src)
    cute.autovec_copy(src, frag)
    return frag


def chunk_values(frag, keep):
    """A loaded fragment as fp32 values, times keep (0.0 for a chunk outside the data)."""
    vals = frag.load().to(Float32)
    return [vals[i] * keep for i in range(cute.size(frag))]


def flag(cond):
    """1.0 where cond holds, else 0.0."""
    return Float32(cutlass.select_(cond, Float32(1.0), Float32(0.0)))


def masked_at(t, k, j, n):
    """t[k, j] as fp32, 0 for the padding columns j >= n."""
    return Float32(cutlass.select_(j < n, t[k, cutlass.min(j, n - 1)].to(Float32), Float32(0.0)))


def row_values(t, row):
    """Row `row` of a matrix with a static column count, as fp32 values (one vectorized load)."""
    src = t[row, None]
    frag = cute.make_rmem_tensor_like(src)
    cute.autovec_copy(src, frag)
    vals = frag.load().to(Float32)
    return [vals[j] for j in range(cute.size(src))]
