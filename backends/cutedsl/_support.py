"""Host side of the CuTeDSL backend: capability, dtype map, compile-once cache, lean launches.

Each kernel is compiled once per process per (dtypes, vector width, compile-time flags) against fake
tensors whose row count, column count and row stride are symbolic, so a new C, V or row stride
reuses the compiled kernel. With apache-tvm-ffi installed the compiled function takes torch tensors
directly (shapes, strides, dtypes and alignment are checked in C, the stream is torch's current
one); without it the DSL's own executor is called with DLPack views, some microseconds more a call.

Compiling needs no GPU: without one, kernels are compiled for ARCH (PTX and a cubin are produced all
the same), which is what the CPU tests check. LIGER_CUTEDSL_DUMP_DIR=<dir> keeps each kernel's cubin
there (and on `compiled.artifacts`) for inspection.
"""

import importlib.util

import torch

import cutlass
import cutlass.cute as cute

from liger_dispatch import Capability, settings

from .._host import compile_cache

PRIORITY = 10
ARCH = "sm_90a"
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int64, torch.int32)
MAX_COLS = 2**31 - 2**20  # column indices are 32-bit inside a row (rows are addressed in 64-bit)

USE_TVM_FFI = settings.CUTEDSL_TVM_FFI.get() and importlib.util.find_spec("tvm_ffi") is not None

CUTE_DTYPE = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
    torch.int64: cutlass.Int64,
    torch.int32: cutlass.Int32,
}


def row_limits(logits, labels):
    """Capability predicate body: why these [C, V] rows and per-row labels are out of reach, or None."""
    if logits.dim() == 2 and logits.shape[1] > MAX_COLS:
        return f"V = {logits.shape[1]} exceeds the kernels' {MAX_COLS} columns per row"
    if labels is not None and labels.dtype not in INDEX_DTYPES:
        return f"labels must be int64 or int32, got {labels.dtype}"
    return None


def capability(predicate):
    return Capability(devices=("cuda",), min_cc=(9, 0), dtypes=FLOAT_DTYPES, modules=("cutlass",),
                      predicate=predicate)


def pick_vec(n_cols, *rows):
    """Columns per vectorized access shared by all `rows` tensors: at most 16 bytes for the narrowest
    dtype, halved until it divides the column count, every row stride and every base address."""
    vec = min(16 // t.element_size() for t in rows)
    while vec > 1 and (n_cols % vec or any(t.stride(0) % vec or t.data_ptr() % (vec * t.element_size()) for t in rows)):
        vec //= 2
    return vec


class Syms:
    """Symbolic sizes shared by the fake tensors of one compile (equal symbols are checked equal at call)."""

    def __init__(self):
        self.rows = cute.sym_int()
        self.cols = cute.sym_int()

    def matrix(self, dtype, vec):
        """[C, V] with unit column stride, row stride a multiple of vec, vec-element aligned."""
        return cute.runtime.make_fake_tensor(
            dtype, (self.rows, self.cols), stride=(cute.sym_int64(divisibility=vec), 1),
            assumed_align=max(vec * dtype.width // 8, 1),
        )

    def per_row(self, dtype):
        """[C], contiguous."""
        return cute.runtime.make_fake_tensor(dtype, (self.rows,), stride=(1,), assumed_align=dtype.width // 8)

    def row_vector(self, dtype, vec):
        """[1, V]: one row of the matrix's columns (a vector read tile by tile with it), vec-element aligned."""
        return cute.runtime.make_fake_tensor(
            dtype, (1, self.cols), stride=(cute.sym_int64(divisibility=vec), 1),
            assumed_align=max(vec * dtype.width // 8, 1),
        )

    @staticmethod
    def flat(dtype=cutlass.Float32):
        """[S], contiguous, S free (a per-row scale of any stride is passed as a flat view, see scale_view)."""
        return cute.runtime.make_fake_tensor(dtype, (cute.sym_int(),), stride=(1,), assumed_align=dtype.width // 8)


def compile_kernel(kernel, *args):
    """cute.compile for this process's calling convention; the stream argument is appended."""
    options = []
    if USE_TVM_FFI:
        options.append("--enable-tvm-ffi")
    if not torch.cuda.is_available():
        options.append(f"--gpu-arch {ARCH}")
    dump_dir = settings.CUTEDSL_DUMP_DIR.get()
    if dump_dir:
        options.append(f"--keep-cubin --dump-dir {dump_dir}")
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=USE_TVM_FFI)
    return cute.compile(kernel, *args, stream, options=" ".join(options) or None)


class Launcher:
    """The per-call entry of a compiled kernel: torch tensors (or None) and Python scalars, positionally.

    With TVM-FFI it calls the underlying tvm_ffi.Function directly, skipping the DSL's Python keyword
    wrapper. Without it, tensors become DLPack views with dynamic layouts (unit stride on the last dim,
    matching the fake tensors) and torch's current stream is appended.
    """

    def __init__(self, compiled):
        self.compiled = compiled  # owns the loaded module
        ffi = getattr(compiled, "__tvm_ffi_object__", None) if USE_TVM_FFI else None
        self._ffi = ffi() if ffi is not None else None

    def __call__(self, *args):
        if self._ffi is not None:
            return self._ffi(*args)
        if USE_TVM_FFI:
            return self.compiled(*args)
        import cuda.bindings.driver as cuda

        args = [cute.runtime.from_dlpack(a).mark_layout_dynamic(leading_dim=a.dim() - 1)
                if isinstance(a, torch.Tensor) else a for a in args]
        return self.compiled(*args, cuda.CUstream(torch.cuda.current_stream().cuda_stream))


def scale_view(grad_scale):
    """grad_scale (None, 0-d or [C] of any stride, e.g. an expanded view) as (flat contiguous view, row step).

    Row i's scale is view[i * step]; no copy and no host sync.
    """
    if grad_scale is None:
        return None, 0
    if grad_scale.dim() == 0 or grad_scale.stride(0) == 0 or grad_scale.shape[0] == 1:
        return grad_scale.as_strided((1,), (1,)), 0
    step = grad_scale.stride(0)
    return grad_scale.as_strided(((grad_scale.shape[0] - 1) * step + 1,), (1,)), step


def per_row(t):
    """A [C] index tensor as the kernels take it: contiguous (a copy only when it is strided)."""
    return None if t is None else t.contiguous()


cache = compile_cache()  # one compiled kernel per distinct key (dtypes, vector width, launch shape, flags)
