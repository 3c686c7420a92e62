"""Host-side pieces every backend needs: bounded caches of compiled kernels and plans, the SM count, scratch
buffers that share one allocation, and the normalization of operands to the layouts the kernels take."""

from __future__ import annotations

import functools
import math
from typing import Callable, Hashable

import torch

INTERPRETER_SMS = 4  # the interpreters' "GPU": small enough that tiny test shapes still exercise the splits


class BoundedCache:
    """A dict of values made once per key, at most `limit` of them: past that it starts over (a run whose row count
    never repeats would otherwise keep one entry per call). Compiled kernels stay alive in their own caches
    (Triton's, Helion's); what a cleared entry costs is one re-plan or one cache lookup there."""

    __slots__ = ("name", "limit", "_values")

    def __init__(self, name: str, limit: int):
        self.name, self.limit = name, limit
        self._values: dict = {}

    def get(self, key: Hashable, make: Callable[[], object]):
        value = self._values.get(key)
        if value is None:
            if len(self._values) >= self.limit:
                self._values.clear()
            value = self._values[key] = make()
        return value

    def drop(self, keep: Callable[[Hashable], bool]) -> None:
        """Forget the entries whose key `keep` rejects."""
        self._values = {k: v for k, v in self._values.items() if keep(k)}

    def clear(self) -> None:
        self._values.clear()

    def values(self) -> list:
        return list(self._values.values())

    def __len__(self) -> int:
        return len(self._values)


def compile_cache(limit: int = 256):
    """Decorator: one result per distinct arguments (a compiled kernel per dtype / vector width / flags), at most
    `limit` kept, least recently used dropped first."""
    return functools.lru_cache(maxsize=limit)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; INTERPRETER_SMS for the interpreters' CPU tensors."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


class Scratch:
    """The layout of one call's scratch buffers in a single allocation: planned once per call signature, each
    buffer at a 256-byte boundary (aligned for any vector access, and as Triton specializes pointers)."""

    ALIGN = 256

    __slots__ = ("names", "parts", "nbytes")

    def __init__(self, buffers: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.names = tuple(buffers)
        self.parts = []
        offset = 0
        for dtype, shape in buffers.values():
            self.parts.append((offset, dtype, shape))
            offset += -(-math.prod(shape) * dtype.itemsize // self.ALIGN) * self.ALIGN
        self.nbytes = offset

    def allocate(self, device: torch.device, addresses: bool) -> tuple[torch.Tensor, dict]:
        """(the allocation, each buffer by name): as its device address (an int, for launchers that take one) when
        `addresses`, else as a tensor view. Keep the allocation alive until the launches are enqueued."""
        memory = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        if addresses:
            base = memory.data_ptr()
            return memory, {name: base + part[0] for name, part in zip(self.names, self.parts)}
        return memory, {name: memory[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                        for name, (offset, dtype, shape) in zip(self.names, self.parts)}


def unit_column_stride(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with unit column stride, any row stride (a copy only when its columns are strided)."""
    return x if x.stride(1) == 1 else x.contiguous()


def contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor contiguous (a copy only when it is not)."""
    return tuple(t if t.is_contiguous() else t.contiguous() for t in tensors)
