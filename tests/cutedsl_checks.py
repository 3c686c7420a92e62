"""What the CuTeDSL kernel tests share: the registered implementation, a compiled kernel's resources, and the
probe that runs the wrappers' launches through TVM-FFI's argument checks without a GPU."""

import ctypes
import os
import struct
import subprocess
import sys

import torch

from liger_dispatch.core.table import TABLE


def cutedsl_impl(op):
    """The CuTeDSL implementation registered for op."""
    (impl,) = [i for i in TABLE.candidates(op) if i.backend == "cutedsl"]
    return impl


def cubin_resources(cubin: bytes) -> dict:
    """Registers, stack frame and local memory of the kernel in a cubin, from its .nv.info records."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    out = {"regs": None, "frame": 0, "local": 0}
    for name_off, _, _, _, offset, size, *_ in sections:
        name = cubin[names_at + name_off:cubin.index(b"\0", names_at + name_off)].decode()
        if name.startswith(".nv.local"):
            out["local"] += size
        if name.startswith(".nv.info"):
            pos = offset
            while pos < offset + size:
                fmt, attr, length = cubin[pos], cubin[pos + 1], struct.unpack_from("<H", cubin, pos + 2)[0]
                if fmt == 0x04:  # EIFMT_SVAL: (function index, value)
                    value = struct.unpack_from("<I", cubin, pos + 8)[0] if length >= 8 else None
                    if attr == 0x2F:
                        out["regs"] = value
                    elif attr == 0x11:
                        out["frame"] = max(out["frame"], value)
                    pos += 4 + length
                else:
                    pos += 4
    return out


def strided_rows(C, V, dtype, pad=0, scale=3.0):
    """Random [C, V] rows on the GPU, a view into rows of V + pad."""
    return (torch.randn(C, V + pad, device="cuda") * scale).to(dtype)[:, :V]


def kl_target(C, V, dtype, log_target):
    """Random target probabilities (log-probabilities with log_target), half of row 0 zero (0 log 0 = 0)."""
    q = torch.softmax(torch.randn(C, V, device="cuda") * 2.0, dim=-1)
    q[0, :V // 2] = 0.0
    return (q.log() if log_target else q).to(dtype)


def check_compiled(launcher) -> None:
    """A kernel compiled for sm_90a (run with LIGER_CUTEDSL_DUMP_DIR set): a cubin, no spills, <= 128 registers."""
    cubin = launcher.compiled.artifacts.CUBIN
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    res = cubin_resources(cubin)
    assert res["frame"] == 0 and res["local"] == 0, res
    assert res["regs"] is not None and res["regs"] <= 128, res  # >= 2 CTAs of 256 threads per SM


def run_probe(path) -> None:
    """Runs `python path` as a child whose main validates the wrappers' launches (CUTE_DSL_ARCH must be set before
    cutlass is imported); it must exit 0 having printed "validated"."""
    from liger_dispatch.backends.cutedsl._support import ARCH

    env = dict(os.environ, CUTE_DSL_ARCH=ARCH)
    proc = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "validated" in proc.stdout


class FakeCuda:
    """A CPU tensor exported through DLPack as if it lived on cuda:0."""

    def __init__(self, t):
        self.t = t

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, **_):
        capsule = self.t.__dlpack__()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        ctypes.c_int32.from_address(get(capsule, b"dltensor") + 8).value = 2  # DLTensor.device.device_type
        return capsule


def validate_only(compiled):
    """A stand-in for a module's compile cache in a probe child: each launch runs TVM-FFI's argument checks (count,
    dtypes, shapes, strides, alignment) on CPU tensors shown as cuda:0 and must fail only for want of a driver."""
    import tvm_ffi

    def key(*k):
        launcher = compiled(*k)

        def call(*args):
            try:
                launcher._ffi(*[tvm_ffi.from_dlpack(FakeCuda(a)) if isinstance(a, torch.Tensor) else a for a in args])
            except RuntimeError as e:
                if "cuda" not in str(e).lower():
                    raise
                return
            raise AssertionError("launched without a GPU")

        return call

    return key
