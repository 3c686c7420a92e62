"""What the Triton kernels of this backend share: capability, launch arguments, in-kernel math helpers."""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver
from triton.language.extra import libdevice

from liger_dispatch import Capability, settings

from .._host import BoundedCache

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # smallest normal fp32: the GPU's fast log2 flushes anything below to 0

INTERPRETING = tl.constexpr(settings.TRITON_INTERPRET.get())
PRIORITY = 20
# Under the interpreter the kernels run on CPU tensors, so the backend accepts them there.
CAPABILITY = Capability(
    devices=("cuda", "cpu") if INTERPRETING else ("cuda",),
    min_cc=(8, 0),
    dtypes=(torch.bfloat16, torch.float16, torch.float32),
    modules=("triton",),
)

# Row kernels run one program per row and stream it in blocks of BLOCK columns: 16 KB of each input per block
# (2-4 16-byte loads a thread at ELEMS_PER_THREAD values), at most MAX_WARPS warps a program, and NUM_STAGES-deep
# software pipelining of the block loads (cp.async into shared memory) so the next blocks are in flight while
# one is reduced; with NUM_STAGES = 1 the loads are plain and carry L2 hints (evict_last on all but the last
# pass, so the next pass finds the row in L2). A RowLaunch knob that is set wins (each op module's LAUNCH, see
# backends/_launch.py: tests force tiny blocks, benchmarks sweep).
# The vocabulary V is a constexpr: one compile per vocabulary, a known trip count, and the interpreter (with
# numpy >= 2.4) cannot take a runtime loop bound.
BLOCK_BYTES = 16384
ELEMS_PER_THREAD = 16
MAX_WARPS = 16
NUM_STAGES = 3


@dataclass(frozen=True)
class RowLaunch:
    """Launch knobs of a row kernel; None: derived by row_launch from the row length and the dtypes."""

    block_size: Optional[int] = None  # columns a block, a power of two
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None


def row_launch(n_cols, *tensors, knobs=RowLaunch()):
    """Launch keywords (BLOCK, NUM_STAGES, num_warps) for a kernel streaming rows of n_cols of these tensors."""
    widest = max(t.element_size() for t in tensors)
    block = knobs.block_size or min(BLOCK_BYTES // widest, triton.next_power_of_2(n_cols))
    warps = knobs.num_warps or max(1, min(MAX_WARPS, block // (32 * ELEMS_PER_THREAD)))
    return dict(BLOCK=block, NUM_STAGES=knobs.num_stages or NUM_STAGES, num_warps=warps)


def scale_args(grad_scale, dummy):
    """grad_scale (None, 0-d or [C], maybe an expanded view) as (pointer, row stride, HAS_SCALE).

    The scale stays on the device and is read in-kernel: no host sync. `dummy` is any tensor on the
    same device, passed as the never-read pointer when there is no scale.
    """
    if grad_scale is None:
        return dummy, 0, False
    if grad_scale.dim() == 0:
        return grad_scale, 0, True
    return grad_scale, grad_scale.stride(0), True


@triton.jit
def load_block(ROW, start, cols, n_cols: tl.constexpr, POLICY: tl.constexpr):
    """Columns start + cols of a row as fp32 (0 past n_cols), and the mask of the real ones."""
    offs = start + cols
    mask = offs < n_cols
    return tl.load(ROW + offs, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32), mask


@triton.jit
def block_start(i, n_cols: tl.constexpr, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """First column of the i-th block a pass visits. A pass that re-reads a row walks it in the other direction
    from the pass before (BACKWARD every other pass), so it starts on the blocks read last, the ones most likely
    still in L2: a row re-read in the same direction evicts each block just before it is needed again (LRU)."""
    if BACKWARD:
        return ((n_cols + BLOCK - 1) // BLOCK - 1 - i) * BLOCK
    else:
        return i * BLOCK


@triton.jit
def online_softmax_step(m, u):
    """One block of an online softmax in base 2 (Milakov & Gimelshein).

    m: running max (scalar); u: this block, masked lanes -inf. Returns the new max, alpha = exp2(m - m_new) that
    sums relative to the old max are rescaled by, and exp2(u - m_new). Only the max is reduced across the block:
    callers keep per-lane sums (d = d * alpha + e) and reduce them once, after the last block.
    """
    m_new = tl.maximum(m, tl.max(u, 0))
    return m_new, tl.exp2(m - m_new), tl.exp2(u - m_new)


@triton.jit
def tanh(x):
    """tanh from one exp2 (portable to the interpreter, which has no libdevice); absolute error ~1e-7."""
    e = tl.exp2((-2.0 * LOG2E) * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def log2(x):
    """log2 on the special-function unit (lg2.approx, relative error ~2^-22, inputs below FLT_MIN give -inf).

    tl.log2 lowers to a ~15-instruction polynomial per element, enough to make the 3-pass JSD compute-bound.
    The interpreter has no libdevice, so it takes tl.log2.
    """
    if INTERPRETING:
        return tl.log2(x)
    else:
        return libdevice.fast_log2f(x)


@triton.jit
def load_scale(SCALE, scale_stride, row, HAS_SCALE: tl.constexpr):
    if HAS_SCALE:
        return tl.load(SCALE + row * scale_stride).to(tl.float32)
    else:
        return 1.0


@triton.jit
def valid_row(LABELS, label_stride, row, ignore_index, HAS_LABELS: tl.constexpr):
    """Whether the row counts: its label is not ignore_index; always without labels."""
    if HAS_LABELS:
        return tl.load(LABELS + row * label_stride) != ignore_index
    else:
        return True


@triton.jit
def load_pair(S, T, start, cols, n_cols: tl.constexpr, to_log2, POLICY: tl.constexpr):
    """load_block of the same columns of two rows, both times to_log2, and the mask of the real columns."""
    s, mask = load_block(S, start, cols, n_cols, POLICY)
    t, _ = load_block(T, start, cols, n_cols, POLICY)
    return s * to_log2, t * to_log2, mask


@triton.jit
def zero_cols(X, n_cols: tl.constexpr, BLOCK: tl.constexpr):
    """An ignored row's gradient: 0 over the whole row X."""
    cols = tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], X.dtype.element_ty)
    for start in range(0, n_cols, BLOCK):
        tl.store(X + start + cols, zeros, mask=start + cols < n_cols)


@triton.jit
def zero_row(X, LOSS, row, n_cols: tl.constexpr, BLOCK: tl.constexpr):
    """An ignored row: gradient 0 over the whole row, loss 0."""
    zero_cols(X, n_cols, BLOCK)
    tl.store(LOSS + row, 0.0)


# ---------------------------------------------------------------- direct launches

_FAST_LAUNCH = not INTERPRETING.value


def _hooked(hook) -> bool:
    """A launch hook is installed (Triton keeps them as hook chains, empty unless a profiler is on)."""
    return hook is not None and bool(getattr(hook, "calls", hook))


def direct_target(*tensors):
    """((device, alignment), stream) for launching compiled kernels directly, or None when this call must go through
    Triton's launch: under the interpreter or with a launch hook installed (profilers). alignment: whether each of
    the tensors (None where None) starts on a 16-byte boundary, besides dtypes the one thing Triton specializes a
    pointer on, so that a Launch keeps one compiled kernel per device and alignment pattern."""
    if not _FAST_LAUNCH or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        return None
    alignment = tuple(None if t is None else not t.data_ptr() & 15 for t in tensors)
    active = driver.active
    device = active.get_current_device()
    return (device, alignment), active.get_current_stream(device)


class Launch:
    """One kernel launch with its grid, scalar arguments and constexprs fixed: a call passes the tensors (or, once
    compiled for the device and the pointers' alignment, their addresses).

    Triton's launch binds and specializes every argument and looks the compiled kernel up: ~15 us of Python.
    The compiled kernel it returns is kept per target, and a call with a direct target hands the arguments
    straight to that kernel's launcher, the tensors as their addresses (given a tensor, the launcher asks the
    driver about each pointer, cuPointerGetAttribute; given an int, it takes it). Sound because the owning plan
    fixes every scalar and dtype, and the compiled kernel is kept per direct target's alignment of the pointers:
    all that Triton specializes on (that every tensor is on the device is the op's check, same_device)."""

    __slots__ = ("kernel", "grid", "scalars", "options", "tail", "compiled")

    def __init__(self, kernel, grid, scalars, *, num_warps, num_stages=3, **constexprs):
        self.kernel, self.grid, self.scalars = kernel, (*grid, 1, 1)[:3], scalars
        self.options = dict(constexprs, num_warps=num_warps, num_stages=num_stages)
        # The launcher takes every parameter positionally: tensors, scalars, then the constexprs, which
        # come last in each kernel's signature here.
        names = kernel.arg_names[len(kernel.arg_names) - len(constexprs):]
        assert set(names) == set(constexprs), (kernel.arg_names, constexprs)
        self.tail = (*scalars, *(constexprs[name] for name in names))
        self.compiled = {}

    def __call__(self, target, *tensors):
        if target is not None:
            compiled = self.compiled.get(target[0])
            if compiled is not None:
                run, function, metadata = compiled
                run(*self.grid, target[1], function, metadata, None, None, None,
                    *[t if type(t) is int else t.data_ptr() for t in tensors], *self.tail)
                return
        kernel = self.kernel[self.grid](*tensors, *self.scalars, **self.options)
        if target is not None and kernel is not None:
            self.compiled[target[0]] = (kernel.run, kernel.function, kernel.packed_metadata)


_row_launches = BoundedCache("triton row-kernel launches", 1024)  # one per kernel and call signature


def launch_row_kernel(kernel, rows: int, args: tuple, scalars: tuple, **options) -> None:
    """kernel[(rows,)](*args, *scalars, **options), one program a row, through a Launch kept per call signature: its
    key holds what Triton specializes a launch on besides the pointers' alignment (direct_target's): each tensor's
    dtype, each int's value, the scalars and the options. A loss kernel's launch then costs ~1 us of Python, not ~15."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    key = (kernel, rows, *[a.dtype if isinstance(a, torch.Tensor) else a for a in args], *scalars, *options.items())
    launch = _row_launches.get(key, lambda: Launch(kernel, (rows,), scalars, **options))
    launch(direct_target(*tensors), *args)
