"""What the CuTeDSL kernel tests share: the registered implementation, and a compiled kernel's resources."""

import struct

from liger_dispatch.table import TABLE


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
