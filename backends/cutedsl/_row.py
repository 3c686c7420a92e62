"""Device-side building blocks of the row kernels: one CTA (or a cluster of `split` CTAs) streams one row of a
[C, V] tensor.

A row is cut into tiles of threads * vec * unroll columns. In tile k, thread t owns `unroll` chunks of
`vec` contiguous columns, chunk u starting at column k * tile + (u * threads + t) * vec, so each chunk
is one 16-byte (or narrower, see _support.pick_vec) access and a warp touches consecutive chunks.
Full tiles run unpredicated; the last, partial tile is predicated per chunk (vec divides V, so a
chunk is wholly in or wholly out of the row).

A kernel reads a row in 2 or 3 passes. With L2 hints, every pass but the last loads with an
evict-last policy, so the next pass finds the row in L2, and the last pass loads, and the gradient
is stored, evict-first (streaming).

Statistics cross the CTA through warp shuffles and one shared-memory round trip per reduction; each
reduction owns its own slots of the shared buffer, so a reduction costs one barrier.

Split rows (RowLaunch.split > 1): a thread-block cluster of `split` CTAs shares a row, CTA r taking the tiles
r, r + split, ... (the partial tile goes to whichever CTA its index falls to). Each reduction then crosses the
cluster too: every CTA publishes its result in its shared memory, one cluster barrier, and every CTA reads all
of them through distributed shared memory and merges them in rank order, so all CTAs hold the same statistics.
Fewer rows are in flight (one per cluster, not per CTA), so the rows a later pass reads again still sit in L2:
with one CTA per row ~130-260 rows of 0.25-0.5 MB are in flight against the 50 MB L2.
"""

import math
import operator
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Boolean, Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
FLT_MIN = 1.1754943508222875e-38  # smallest normal fp32: the fast log2 flushes anything below to 0
# Finite "minus infinity" for running maxima: exp2(m_old - m_new) stays 1 or 0, never NaN (-inf - -inf).
NEG_BIG = -3.0e38
# createpolicy.fractional.L2::evict_{last,first}.b64 with fraction 1.0 (CUTLASS's CacheHintSm90 values).
EVICT_LAST = 0x14F0000000000000
EVICT_FIRST = 0x12F0000000000000


@dataclass(frozen=True)
class RowLaunch:
    """Launch shape of a row kernel (part of its compile key)."""

    threads: int = 256  # per CTA, a power of two from 64 to 1024
    unroll: int = 4  # vectorized accesses in flight per thread and input
    l2_hints: bool = True
    split: int = 1  # CTAs a row is cut across, a cluster of them: 1, 2, 4 or 8 (the portable cluster sizes)

    @property
    def warps(self):
        return self.threads // 32

    def tile(self, vec):
        return self.threads * vec * self.unroll

    def over_rows(self, rows):
        """The launch arguments (grid, block, cluster) of a kernel over `rows` rows."""
        if self.split == 1:
            return dict(grid=[rows, 1, 1], block=[self.threads, 1, 1])
        return dict(grid=[rows * self.split, 1, 1], block=[self.threads, 1, 1], cluster=[self.split, 1, 1])


def place(launch: RowLaunch):
    """(the row this CTA works on, its rank among the row's CTAs)."""
    block, _, _ = cute.arch.block_idx()
    if const_expr(launch.split == 1):
        return block, Int32(0)
    return block // launch.split, block % launch.split  # a 1-D cluster: the rank is block_idx_in_cluster


@dataclass(frozen=True)
class RowTiles:
    """Thread `tidx`'s chunks of row `row` of mX, tile by tile (plain Python, traced inline).

    Frozen, so that the DSL treats its use inside a run-time `if` or loop as a read.
    """

    g_row: cute.Tensor
    c_row: cute.Tensor
    n_cols: object
    thr_load: object
    thr_store: object
    load_copy: cute.TiledCopy
    store_copy: cute.TiledCopy
    tile: int
    l2_hints: bool
    rank: object
    split: int

    @staticmethod
    def of(mX: cute.Tensor, row, tidx, vec: int, launch: RowLaunch, rank=None):
        """Row `row` of mX as this thread sees it; with launch.split > 1, the tiles of the CTA of rank `rank`
        (tile k here is the row's tile k * split + rank), which a kernel that splits rows passes (place())."""
        if launch.split > 1 and rank is None:
            raise ValueError(f"this kernel takes a row per CTA: launch.split must be 1, got {launch.split}")
        dtype = mX.element_type
        bits = vec * dtype.width
        threads, values = cute.make_layout(launch.threads), cute.make_layout(vec)
        load = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=bits), threads, values)
        store = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), dtype, num_bits_per_copy=bits,
                                store_cache_mode=cute.nvgpu.StoreCacheMode.STREAMING), threads, values)
        return RowTiles(mX[row, None], cute.make_identity_tensor(mX.shape[1]), mX.shape[1], load.get_slice(tidx),
                        store.get_slice(tidx), load, store, launch.tile(vec), launch.l2_hints,
                        0 if rank is None else rank, launch.split)

    def _tile(self, t, k):
        if const_expr(self.split == 1):
            return cute.local_tile(t, (self.tile,), (k,))
        return cute.local_tile(t, (self.tile,), (k * self.split + self.rank,))

    def _src(self, k):
        return self.thr_load.partition_S(self._tile(self.g_row, k))

    def _policy(self, keep):
        if const_expr(not self.l2_hints):
            return {}
        return {"cache_policy": Int64(EVICT_LAST if keep else EVICT_FIRST)}

    def predicate(self, k):
        """Per-chunk in-row flags of tile k, shaped as cute.copy's `pred` wants it."""
        coords = self.thr_load.partition_S(self._tile(self.c_row, k))
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

    def load(self, k, pred=None, fill=0.0, keep=False):
        """Tile k of this thread as fp32 (TensorSSA); chunks outside the row read as `fill`.

        keep: a later pass reads this tile again (evict-last in L2), else evict-first.
        """
        src = self._src(k)
        frag = cute.make_rmem_tensor_like(src)
        if const_expr(pred is not None):
            frag.fill(fill)
        cute.copy(self.load_copy, src, frag, pred=pred, **self._policy(keep))
        return frag.load().to(Float32)

    def store(self, k, values, pred=None):
        """Write fp32 `values` (TensorSSA of a tile) to tile k, rounded to the row's dtype, streaming."""
        dst = self.thr_store.partition_D(self._tile(self.g_row, k))
        frag = cute.make_rmem_tensor_like(dst)
        frag.store(values.to(dst.element_type))
        cute.copy(self.store_copy, frag, dst, pred=pred, **self._policy(False))

    def span(self):
        """(full tiles of the row, whether a partial tile follows them), of this CTA's share of the row."""
        n_full, tail = self.n_cols // self.tile, self.n_cols % self.tile != 0
        if const_expr(self.split == 1):
            return n_full, tail
        mine = (n_full - self.rank + (self.split - 1)) // self.split
        return mine, tail & (n_full % self.split == self.rank)

    def columns(self, k):
        """Column index of each element of tile k (TensorSSA of Int32)."""
        coords = self.thr_load.partition_S(self._tile(self.c_row, k))
        cols = self._fragment(Int32)
        for i in range(cute.size(cols)):
            cols[i] = coords[i]
        return cols.load()


@cute.jit
def lse_merge(m_a: Float32, d_a: Float32, m_b: Float32, d_b: Float32):
    """Merge two base-2 softmax states (max m, sum d of exp2(x - m))."""
    m = cute.arch.fmax(m_a, m_b)
    d = d_a * cute.math.exp2(m_a - m, fastmath=True) + d_b * cute.math.exp2(m_b - m, fastmath=True)
    return m, d


@cute.jit
def online_softmax_step(m: Float32, d: Float32, x2: cute.TensorSSA):
    """One tile of an online softmax in base 2: fold the tile's values (padding = -inf) into the running
    (max, sum exp2) state."""
    m_new = cute.arch.fmax(m, x2.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0))
    e = cute.math.exp2(x2 - m_new, fastmath=True)
    d = d * cute.math.exp2(m - m_new, fastmath=True) + e.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)
    return m_new, d


def tile_sum(x: cute.TensorSSA):
    return x.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=0)


def reduction_buffer(warps: int, n_slots: int, smem=None):
    """Shared fp32 scratch of warps x n_slots for the block reductions of one kernel (from `smem`, an allocator the
    kernel's other shared tensors come from too, else a new one)."""
    smem = cutlass.memory.SmemAllocator() if smem is None else smem
    return smem.allocate_tensor(Float32, cute.make_layout((warps, n_slots)), byte_alignment=16)


@cute.jit
def block_lse(m: Float32, d: Float32, buf: cute.Tensor, slot: cutlass.Constexpr[int]):
    """CTA-wide merge of per-thread softmax states; every thread gets the result. Uses slots slot, slot+1."""
    warps = const_expr(cute.size(buf, mode=[0]))
    for i in cutlass.range_constexpr(5):
        off = 16 >> i
        m, d = lse_merge(m, d, cute.arch.shuffle_sync_bfly(m, offset=off), cute.arch.shuffle_sync_bfly(d, offset=off))
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        buf[warp, slot] = m
        buf[warp, slot + 1] = d
    cute.arch.barrier()
    # Every group of `warps` lanes holds all warps' states, so every lane ends with the CTA's.
    m = buf[lane % warps, slot]
    d = buf[lane % warps, slot + 1]
    for i in cutlass.range_constexpr(int(math.log2(warps))):
        off = (warps // 2) >> i
        m, d = lse_merge(m, d, cute.arch.shuffle_sync_bfly(m, offset=off), cute.arch.shuffle_sync_bfly(d, offset=off))
    return m, d


@cute.jit
def block_sum(vals: tuple, buf: cute.Tensor, slot: cutlass.Constexpr[int]):
    """CTA-wide sums of a tuple of per-thread fp32 values; every thread gets them. Uses len(vals) slots."""
    warps = const_expr(cute.size(buf, mode=[0]))
    n = const_expr(len(vals))
    partial = [cute.arch.warp_reduction(v, operator.add) for v in vals]
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        for j in cutlass.range_constexpr(n):
            buf[warp, slot + j] = partial[j]
    cute.arch.barrier()
    return tuple(
        cute.arch.warp_reduction(buf[lane % warps, slot + j], operator.add, threads_in_group=warps) for j in range(n)
    )


@cute.jit
def block_max(value: Float32, buf: cute.Tensor, slot: cutlass.Constexpr[int]):
    """CTA-wide max of a per-thread fp32 value; every thread gets it. Uses one slot."""
    warps = const_expr(cute.size(buf, mode=[0]))
    partial = cute.arch.warp_reduction(value, cute.arch.fmax)
    lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
    if lane == 0:
        buf[warp, slot] = partial
    cute.arch.barrier()
    return cute.arch.warp_reduction(buf[lane % warps, slot], cute.arch.fmax, threads_in_group=warps)


@dataclass(frozen=True)
class RowReductions:
    """A row kernel's reductions: CTA-wide, then across the row's cluster when the row is split. Every thread of
    every CTA of the row gets the same result; a split kernel ends with done()."""

    buf: cute.Tensor  # [warps, n_slots]: the CTA-wide reductions' scratch
    shared: object  # [n_slots]: this CTA's results, which the cluster's CTAs read (None when not split)
    split: int

    @staticmethod
    def of(launch: RowLaunch, n_slots: int):
        smem = cutlass.memory.SmemAllocator()
        buf = reduction_buffer(launch.warps, n_slots, smem)
        shared = None
        if const_expr(launch.split > 1):
            shared = smem.allocate_tensor(Float32, cute.make_layout(n_slots), byte_alignment=16)
        return RowReductions(buf, shared, launch.split)

    def lse(self, m: Float32, d: Float32, slot: int):
        """block_lse, then across the cluster. Uses slots slot, slot+1."""
        m, d = block_lse(m, d, self.buf, slot)
        if const_expr(self.split == 1):
            return m, d
        return cluster_lse(m, d, self.shared, slot, self.split)

    def sum(self, vals: tuple, slot: int):
        """block_sum, then across the cluster. Uses len(vals) slots."""
        vals = block_sum(vals, self.buf, slot)
        if const_expr(self.split == 1):
            return vals
        return cluster_sum(vals, self.shared, slot, self.split)

    def max(self, value: Float32, slot: int):
        """block_max, then across the cluster. Uses one slot."""
        value = block_max(value, self.buf, slot)
        if const_expr(self.split == 1):
            return value
        return cluster_max(value, self.shared, slot, self.split)

    def done(self):
        """A split kernel's last step: no CTA leaves while another may still read its shared results."""
        if const_expr(self.split > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()


@cute.jit
def publish(values: tuple, shared: cute.Tensor, slot: cutlass.Constexpr[int]):
    """Thread 0 writes this CTA's results to its slots; on return every CTA of the cluster has written its own."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        for j in cutlass.range_constexpr(len(values)):
            shared[slot + j] = values[j]
    cute.arch.cluster_arrive()  # release: the writes above are visible to the cluster after its wait
    cute.arch.cluster_wait()


@dsl_user_op
def peer_load(shared: cute.Tensor, index: int, rank, *, loc=None, ip=None) -> Float32:
    """shared[index] of the cluster's CTA of rank `rank`: mapa, then ld.shared::cluster (CuTe's tensors do not
    load from distributed shared memory). Volatile, so that it stays after the cluster barrier."""
    local = (shared.iterator + index).toint(loc=loc, ip=ip).ir_value()
    return Float32(llvm.inline_asm(
        T.f32(), [local, Int32(rank).ir_value(loc=loc, ip=ip)],
        "{\n.reg .u32 remote;\nmapa.shared::cluster.u32 remote, $1, $2;\nld.shared::cluster.f32 $0, [remote];\n}",
        "=f,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def cluster_lse(m: Float32, d: Float32, shared: cute.Tensor, slot: cutlass.Constexpr[int],
                split: cutlass.Constexpr[int]):
    publish((m, d), shared, slot)
    m, d = peer_load(shared, slot, 0), peer_load(shared, slot + 1, 0)
    for r in cutlass.range_constexpr(1, split):
        m, d = lse_merge(m, d, peer_load(shared, slot, r), peer_load(shared, slot + 1, r))
    return m, d


@cute.jit
def cluster_sum(vals: tuple, shared: cute.Tensor, slot: cutlass.Constexpr[int], split: cutlass.Constexpr[int]):
    publish(vals, shared, slot)
    n = const_expr(len(vals))
    out = [peer_load(shared, slot + j, 0) for j in range(n)]
    for r in cutlass.range_constexpr(1, split):
        out = [out[j] + peer_load(shared, slot + j, r) for j in range(n)]
    return tuple(out)


@cute.jit
def cluster_max(value: Float32, shared: cute.Tensor, slot: cutlass.Constexpr[int], split: cutlass.Constexpr[int]):
    publish((value,), shared, slot)
    out = peer_load(shared, slot, 0)
    for r in cutlass.range_constexpr(1, split):
        out = cute.arch.fmax(out, peer_load(shared, slot, r))
    return out


def tile_max(x: cute.TensorSSA):
    return x.reduce(cute.ReductionOp.MAX, init_val=-Float32.inf, reduction_profile=0)


def valid_row(mLabels, row, ignore_index):
    """Whether the row counts: its label is not ignore_index; always without labels (mLabels None)."""
    if const_expr(mLabels is None):
        return Boolean(True)
    return mLabels[row] != ignore_index


@cute.jit
def zero_row(tiles: RowTiles, n_full: Int32, tail: Boolean):
    """Write 0 over the whole row (ignored rows)."""
    zeros = tiles.full(0.0)
    for k in cutlass.range(n_full, unroll=1):
        tiles.store(k, zeros)
    if tail:
        tiles.store(n_full, zeros, tiles.predicate(n_full))
