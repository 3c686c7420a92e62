"""What the Helion kernels of this backend share: capability, config lookup, compiled-kernel cache, launch helpers.

Configs come from the committed tables in configs/<kernel>.json, keyed by GPU family ("sm90"), dtype ("bf16")
and a shape bucket (a power of two); a key the table lacks falls back to the kernel's hand-written default.
LIGER_HELION_AUTOTUNE=1 hands the choice to Helion's autotuner instead (slow on first call; results cached on
disk by Helion). benchmarks/helion_tune.py regenerates the tables.
"""

import contextlib
import dataclasses
import functools
import json
import threading
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import helion
import helion.language as hl

from liger_dispatch import Capability, settings

from .._host import BoundedCache

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
FLT_MIN = 1.1754943508222875e-38  # smallest normal fp32: the fast log2 flushes anything below to 0
KEEP, STREAM = "evict_last", "evict_first"  # load eviction: a row is read again by a later pass / the last time

# Helion's generated Triton runs in Triton's interpreter under TRITON_INTERPRET=1; HELION_INTERPRET=1 runs the
# kernel bodies eagerly in PyTorch. Either way the kernels take CPU tensors.
TRITON_INTERPRETER = settings.TRITON_INTERPRET.get()
HELION_INTERPRETER = settings.HELION_INTERPRET.get()
INTERPRETED = TRITON_INTERPRETER or HELION_INTERPRETER
DEVICES = ("cuda", "cpu") if INTERPRETED else ("cuda",)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_CC = (8, 0)
AUTOTUNE = settings.HELION_AUTOTUNE.get()
CONFIG_DIR = Path(settings.HELION_CONFIG_DIR.get() or Path(__file__).with_name("configs"))

PRIORITY = 30
RUNS_LIMIT = 1024  # prepared launches a kernel keeps (one per call signature)
CAPABILITY = Capability(devices=DEVICES, min_cc=MIN_CC, dtypes=DTYPES, modules=("helion",))
# Kernels with hl.dot: HELION_INTERPRET=1 runs it as torch.mm(out_dtype=...), which PyTorch has no CPU kernel for.
DOT_CAPABILITY = dataclasses.replace(CAPABILITY, devices=("cuda", "cpu") if TRITON_INTERPRETER else ("cuda",))


# ---------------------------------------------------------------- configs


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def bucket(n: int) -> int:
    """The shape bucket of a size: the next power of two."""
    return 1 << max(0, int(n) - 1).bit_length()


@functools.cache
def device_family(device: torch.device) -> str:
    """"sm90" for an H100/H200, "cpu" for interpreted runs."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def config_key(family: str, dtype: torch.dtype, shape_key) -> str:
    """"sm90/bf16/131072": family, dtype, shape bucket (a tuple of them is joined by "x")."""
    shape = "x".join(map(str, shape_key)) if isinstance(shape_key, tuple) else str(shape_key)
    return f"{family}/{DTYPE_NAMES.get(dtype, str(dtype))}/{shape}"


def config_path(kernel_name: str) -> Path:
    return CONFIG_DIR / f"{kernel_name}.json"


@functools.cache
def config_table(kernel_name: str) -> dict:
    """{key: entry} of configs/<kernel_name>.json (entry: {"config": ..., "source": ..., timings}); {} if none."""
    path = config_path(kernel_name)
    return json.loads(path.read_text())["configs"] if path.exists() else {}


def lookup_config(kernel_name: str, key: str, default: dict) -> tuple[dict, str]:
    """(config, source): the committed entry for key ("tuned", or a "default" written out), else the default."""
    entry = config_table(kernel_name).get(key)
    if entry is None:
        return default, "default (not in the table)"
    return entry["config"], entry.get("source", "tuned")


# ---------------------------------------------------------------- kernels


class Kernel:
    """A Helion kernel body and its config table.

    One Helion kernel per index width (its front end runs once per input specialization, dynamic shapes: a new
    N recompiles nothing), code generated once per config. Each call looks the config up by the device family,
    the dtype of `like` and `shape_key` (bucket(V) for the loss kernels); default_config(shape_key) is the
    hand-written fallback. `int64` asks for 64-bit offsets (Helion's own check looks at numel, not strides).
    A repeated call (same tensor metadata, as Helion's own fast path keys it) goes straight to the launcher.
    """

    instances: list["Kernel"] = []  # every kernel, for reload_configs

    def __init__(self, fn: Callable, name: str, default_config: Callable[..., dict]):
        self.fn = fn
        self.name = name
        self.default_config = default_config
        self.forced: Optional[dict] = None
        self._runs = BoundedCache(f"helion {name} launches", RUNS_LIMIT)
        Kernel.instances.append(self)

    def __call__(self, *args, like: torch.Tensor, shape_key, int64: bool = False):
        key = (id(self.forced), int64, *map(_arg_key, args))
        run = self._runs.get(key, lambda: self._prepare(args, like, shape_key, int64))
        if not TRITON_INTERPRETER:
            return run(*args)
        with interpreter_fixes():
            return run(*args)

    def _prepare(self, args, like, shape_key, int64):
        bound = self.helion_kernel(int64).bind(args)
        if AUTOTUNE or HELION_INTERPRETER:  # autotunes on a first call / runs the body eagerly
            return bound
        config = self.forced or self.config(like.device, like.dtype, shape_key)[0]
        return bound.compile_config(helion.Config(**config))

    @functools.lru_cache(maxsize=None)
    def config(self, device: torch.device, dtype: torch.dtype, shape_key) -> tuple[dict, str]:
        """(config, source) for calls on device with this dtype and shape key."""
        key = config_key(device_family(device), dtype, shape_key)
        return lookup_config(self.name, key, self.default_config(shape_key))

    @functools.lru_cache(maxsize=None)
    def helion_kernel(self, int64: bool) -> helion.Kernel:
        settings = dict(
            static_shapes=False,
            index_dtype=torch.int64 if int64 else torch.int32,
            dot_precision="ieee",  # fp32 operands stay fp32 (no tf32); 16-bit ones are unaffected
        )
        if not AUTOTUNE:  # else Helion's own effort setting (HELION_AUTOTUNE_EFFORT) applies
            settings["autotune_effort"] = "none"
        return helion.kernel(self.fn, **settings)

    @contextlib.contextmanager
    def using(self, config: dict):
        """Run every call in this block with `config` (tests, tuning)."""
        saved, self.forced = self.forced, config
        try:
            yield
        finally:
            self.forced = saved
            self._runs.drop(lambda key: key[0] != id(config))


def _arg_key(arg):
    """What a kernel argument contributes to the launch cache key: tensor metadata, int and bool values."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.shape, arg.stride(), arg.device
    return arg if arg is None or isinstance(arg, (bool, int)) else type(arg)


def reload_configs() -> None:
    """Forget the tables read so far (after CONFIG_DIR changed, or the files did)."""
    config_table.cache_clear()
    Kernel.config.cache_clear()
    for kernel in Kernel.instances:
        kernel._runs.clear()


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether an element offset of any tensor (strides included) can exceed int32."""
    for t in tensors:
        if t is not None and t.numel() > 0:
            span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
            if span > 2**31 - 1:
                return True
    return False


def row_scale(grad_scale: Optional[torch.Tensor], rows: int, like: torch.Tensor) -> torch.Tensor:
    """grad_scale as a [rows] fp32 view the kernels index per row (stride 0 for 0-d or None); no host sync."""
    if grad_scale is None:
        return _ones(like.device).expand(rows)
    if grad_scale.dim() == 0:
        return grad_scale.to(torch.float32).expand(rows)
    return grad_scale.to(torch.float32)


@functools.cache
def _ones(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """x [C, V] with unit column stride as the 1-D span of its storage, for one-element gathers at row*stride + j."""
    span = (x.shape[0] - 1) * x.stride(0) + x.shape[1]
    return x.as_strided((span,), (1,))


# ---------------------------------------------------------------- Triton interpreter


@functools.cache
def _interpreter_patches() -> tuple:
    """(owner, attribute, replacement) for three gaps of Triton's interpreter that Helion's generated code falls
    into; compiled Triton is untouched.

    - Helion lowers torch.exp2 / log2 / tanh / rsqrt to libdevice, which compiled Triton links from the CUDA
      libdevice and the interpreter leaves as empty stubs: here they compute in numpy on the interpreter's arrays.
    - With dynamic shapes, loops run to a runtime bound (`tl.range(0, V, BLOCK)`), which the interpreter turns
      into int() of a 1-element array, an error since numpy 2: take the element instead.
    - tl.dot of bf16 operands multiplies their raw uint16 bits: widen them to fp32 first.
    """
    from triton.language.extra import libdevice
    from triton.runtime import interpreter
    from triton.runtime.interpreter import TensorHandle
    import triton.language as tl

    def unary(np_fn):
        def fn(x):
            data = x.handle.data
            with np.errstate(all="ignore"):
                out = np_fn(data).astype(data.dtype)
            return tl.core.tensor(TensorHandle(out, x.handle.dtype.scalar), x.type)

        return fn

    patches = [(libdevice, name, unary(np_fn)) for name, np_fn in {
        "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "tanh": np.tanh,
        "rsqrt": lambda a: 1.0 / np.sqrt(a), "sqrt": np.sqrt,
    }.items()]

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen_bf16(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen_bf16(a), widen_bf16(b), d, input_precision, max_num_imprecise_acc)

    patches += [(interpreter, "_patch_lang_tensor", patch_tensor_index),
                (interpreter.InterpreterBuilder, "create_dot", create_dot_bf16)]
    return tuple(patches)


_interpreter_lock = threading.RLock()


@contextlib.contextmanager
def interpreter_fixes():
    """Triton's interpreter with _interpreter_patches applied while a Helion kernel runs in it, and as shipped
    again afterwards: Triton's own kernels, the triton backend's included, never see them. One thread at a time."""
    with _interpreter_lock:
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in _interpreter_patches()]
        for owner, name, value in _interpreter_patches():
            setattr(owner, name, value)
        try:
            yield
        finally:
            for owner, name, value in saved:
                setattr(owner, name, value)


# ---------------------------------------------------------------- in-kernel helpers (inlined by Helion)


if HELION_INTERPRETER:  # eager PyTorch: no Triton to inline
    exp2, log2 = torch.exp2, torch.log2
else:
    def exp2(x):
        """2^x as Triton's own exp2 (ex2.approx); torch.exp2 would lower to libdevice's."""
        return hl.inline_triton("tl.math.exp2({0})", args=(x,), output_like=x)

    def log2(x):
        """log2 x as Triton's own log2 (lg2.approx); torch.log2 lowers to libdevice's exact, slower one."""
        return hl.inline_triton("tl.math.log2({0})", args=(x,), output_like=x)


def row_config(v_bucket: int, max_block: int) -> dict:
    """The default config of a row kernel: one row a program, blocks of up to max_block columns, 8 warps at the
    largest block (a fixed number of fp32 lanes a thread)."""
    block_v = min(max_block, max(16, v_bucket))
    return {"block_sizes": [1, block_v], "num_warps": max(1, min(8, block_v * 8 // max_block)), "num_stages": 1}


def valid_rows(labels, tile_c, ignore_index):
    """The rows of tile_c whose label is not ignore_index (all of them without labels)."""
    if labels is not None:
        return labels[tile_c] != ignore_index
    return hl.full([tile_c], 1, dtype=torch.int32) != 0


def load_f32(x, tile_c, tile_v, row_mask, policy):
    """x[tile_c, tile_v] in fp32; rows where row_mask [rows, 1] is False are not read (0)."""
    return hl.load(x, [tile_c, tile_v], extra_mask=row_mask, eviction_policy=policy).to(torch.float32)


def online_softmax_step(m, u, in_row):
    """One block of an online softmax in base 2 (Milakov & Gimelshein) over rows of u.

    m: running max per row; u: this block's base-2 logits. Returns the new max, alpha [rows, 1] that sums kept
    relative to the old max are rescaled by, and exp2(u - m_new) (0 past the row end). Callers keep per-lane
    sums (d = d * alpha + e) and reduce them once, after the last block: only the max is reduced per block.
    """
    m_new = torch.maximum(m, torch.amax(u, dim=1))
    alpha = exp2(m - m_new).unsqueeze(1)
    return m_new, alpha, torch.where(in_row, exp2(u - m_new.unsqueeze(1)), 0.0)
