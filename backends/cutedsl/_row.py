"""Device-side building blocks of the row kernels: one CTA streams one row of a [C, V] tensor.

A row is cut into tiles of THREADS * vec * unroll columns. In tile k, thread t owns `unroll` chunks of
`vec` contiguous columns, chunk u starting at column k * tile + (u * THREADS + t) * vec, so each chunk
is one 16-byte (or narrower, see _support.pick_vec) load and a warp reads consecutive chunks. Full
tiles run unpredicated; the last, partial tile is predicated per chunk (vec divides V, so a chunk is
either wholly in or wholly out of the row).

Statistics cross the CTA through warp shuffles and one shared-memory round trip per reduction; each
reduction owns its own slots of the shared buffer, so a reduction costs one barrier.
"""

import math
import operator
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Boolean, Float32, Int32, const_expr

THREADS = 256
WARPS = THREADS // 32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Finite "minus infinity" for running maxima: exp2(m_old - m_new) stays 1 or 0, never NaN (-inf - -inf).
NEG_BIG = -3.0e38


def row_copy(dtype, vec: int):
    """TiledCopy of THREADS threads, `vec` contiguous elements (one vectorized access) each."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=vec * dtype.width)
    return cute.make_tiled_copy_tv(atom, cute.make_layout(THREADS), cute.make_layout(vec))


@dataclass(frozen=True)
class RowTiles:
    """Thread `tidx`'s chunks of row `row` of mX, tile by tile (plain Python, traced inline).

    Frozen, so that the DSL treats its use inside a run-time `if` or loop as a read.
    """

    g_row: cute.Tensor
    c_row: cute.Tensor
    n_cols: object
    thr: object
    tiled_copy: cute.TiledCopy
    tile: int

    @staticmethod
    def of(mX: cute.Tensor, row, tidx, tiled_copy: cute.TiledCopy, tile: int):
        return RowTiles(mX[row, None], cute.make_identity_tensor(mX.shape[1]), mX.shape[1],
                        tiled_copy.get_slice(tidx), tiled_copy, tile)

    def _src(self, k):
        return self.thr.partition_S(cute.local_tile(self.g_row, (self.tile,), (k,)))

    def predicate(self, k):
        """Per-chunk in-row flags of tile k, shaped as cute.copy's `pred` wants it."""
        coords = self.thr.partition_S(cute.local_tile(self.c_row, (self.tile,), (k,)))
        n_chunks = cute.size(coords, mode=[1])
        pred = cute.make_rmem_tensor(cute.make_layout((1, n_chunks)), Boolean)
        for u in range(n_chunks):
            pred[0, u] = cute.elem_less(coords[(0, 0), u], self.n_cols)
        return pred

    def _fragment(self, dtype):
        return cute.make_rmem_tensor_like(self._src(0), dtype)

    def element_mask(self, pred):
        """Per-element flags (TensorSSA) from per-chunk flags."""
        frag = self._fragment(Boolean)
        vec = cute.size(frag) // cute.size(pred)
        for i in range(cute.size(frag)):
            frag[i] = pred[0, i // vec]
        return frag.load()

    def full(self, value):
        """A tile's worth of fp32 `value` (TensorSSA)."""
        frag = self._fragment(Float32)
        frag.fill(value)
        return frag.load()

    def load(self, k, pred=None, fill=0.0):
        """Tile k of this thread as fp32 (TensorSSA); chunks outside the row read as `fill`."""
        src = self._src(k)
        frag = cute.make_rmem_tensor_like(src)
        if const_expr(pred is not None):
            frag.fill(fill)
        cute.copy(self.tiled_copy, src, frag, pred=pred)
        return frag.load().to(Float32)

    def store(self, k, values, pred=None):
        """Write fp32 `values` (TensorSSA of a tile) to tile k, rounded to the row's dtype."""
        dst = self.thr.partition_D(cute.local_tile(self.g_row, (self.tile,), (k,)))
        frag = cute.make_rmem_tensor_like(dst)
        frag.store(values.to(dst.element_type))
        cute.copy(self.tiled_copy, frag, dst, pred=pred)

    def columns(self, k):
        """Column index of each element of tile k (TensorSSA of Int32)."""
        coords = self.thr.partition_S(cute.local_tile(self.c_row, (self.tile,), (k,)))
        cols = self._fragment(Int32)
        for i in range(cute.size(cols)):
            cols[i] = coords[i]
        return cols.load()


def n_full_tiles(n_cols, tile: int):
    return n_cols // tile


def has_tail(n_cols, tile: int):
    return n_cols % tile != 0


@cute.jit
def lse_merge(m_a: Float32, d_a: Float32, m_b: Float32, d_b: Float32):
    """Merge two base-2 softmax states (max m, sum d of exp2(x - m))."""
    m = cute.arch.fmax(m_a, m_b)
    d = d_a * cute.math.exp2(m_a - m, fastmath=True) + d_b * cute.math.exp2(m_b - m, fastmath=True)
    return m, d


@cute.jit
def lse_update(m: Float32, d: Float32, x2: cute.TensorSSA):
    """Fold a tile of base-2 values (padding = -inf) into the running (max, sum exp2) state."""
    m_new = cute.arch.fmax(m, x2.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0))
    e = cute.math.exp2(x2 - m_new, fastmath=True)
    d = d * cute.math.exp2(m - m_new, fastmath=True) + e.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
    return m_new, d


def tile_sum(x: cute.TensorSSA):
    return x.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)


def reduction_buffer(n_slots: int):
    """Shared fp32 scratch of WARPS x n_slots for the block reductions of one kernel."""
    smem = cutlass.memory.SmemAllocator()
    return smem.allocate_tensor(Float32, cute.make_layout((WARPS, n_slots)), byte_alignment=16)


@cute.jit
def block_lse(m: Float32, d: Float32, buf: cute.Tensor, slot: cutlass.Constexpr[int]):
    """CTA-wide merge of per-thread softmax states; every thread gets the result. Uses slots slot, slot+1."""
    for i in cutlass.range_constexpr(5):
        off = 16 >> i
        m, d = lse_merge(m, d, cute.arch.shuffle_sync_bfly(m, offset=off), cute.arch.shuffle_sync_bfly(d, offset=off))
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        buf[warp, slot] = m
        buf[warp, slot + 1] = d
    cute.arch.barrier()
    # Every group of WARPS lanes holds all warps' states, so every lane ends with the CTA's.
    m = buf[lane % WARPS, slot]
    d = buf[lane % WARPS, slot + 1]
    for i in cutlass.range_constexpr(int(math.log2(WARPS))):
        off = (WARPS // 2) >> i
        m, d = lse_merge(m, d, cute.arch.shuffle_sync_bfly(m, offset=off), cute.arch.shuffle_sync_bfly(d, offset=off))
    return m, d


@cute.jit
def block_sum(vals: tuple, buf: cute.Tensor, slot: cutlass.Constexpr[int]):
    """CTA-wide sums of a tuple of per-thread fp32 values; every thread gets them. Uses len(vals) slots."""
    n = const_expr(len(vals))
    partial = [cute.arch.warp_reduction(v, operator.add) for v in vals]
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        for j in cutlass.range_constexpr(n):
            buf[warp, slot + j] = partial[j]
    cute.arch.barrier()
    return tuple(
        cute.arch.warp_reduction(buf[lane % WARPS, slot + j], operator.add, threads_in_group=WARPS) for j in range(n)
    )


@cute.jit
def zero_row(tiles: RowTiles, n_full: Int32, tail: Boolean):
    """Write 0 over the whole row (ignored rows)."""
    zeros = tiles.full(0.0)
    for k in cutlass.range(n_full, unroll=1):
        tiles.store(k, zeros)
    if tail:
        tiles.store(n_full, zeros, tiles.predicate(n_full))
