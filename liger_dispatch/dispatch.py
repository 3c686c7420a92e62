"""The public entry points: `dispatch.op(name)`, `available_backends`, `registered_backends`."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from liger_dispatch import selection, vocab_parallel
from liger_dispatch.table import TABLE, Impl, reference_last


class Explanation:
    """What `OpHandle.explain` returns: the implementation that would run, and why the others would not."""

    def __init__(self, impl: Optional[Impl], lines: list[str]):
        self.impl = impl
        self.backend = impl.backend if impl is not None else None
        self.lines = lines

    def __str__(self) -> str:
        return "\n".join(self.lines)

    __repr__ = __str__


class OpHandle:
    """A callable for one op, optionally pinned to backends; checks inputs, selects, calls."""

    __slots__ = ("name", "pinned", "_check", "_vocab_parallel")

    def __init__(self, name: str, backend: Union[None, str, Sequence[str]] = None):
        self.name = TABLE.canonical(name)
        self.pinned = selection.parse_backends(backend)
        self._check = TABLE.spec(self.name).check
        self._vocab_parallel = self.name in vocab_parallel.WEIGHT_ARGUMENT  # takes process_group= / DTensor weights

    def __call__(self, *args, **kwargs):
        self._check(*args, **kwargs)
        impl = selection.select(self.name, self.pinned, args, kwargs)
        if self._vocab_parallel:
            return vocab_parallel.call(self.name, impl, args, kwargs)
        return impl.fn(*args, **kwargs)

    def select(self, *args, **kwargs) -> Impl:
        """The implementation that would serve this call (with the same warnings a call would give)."""
        self._check(*args, **kwargs)
        return selection.select(self.name, self.pinned, args, kwargs)

    def explain(self, *args, **kwargs) -> Explanation:
        self._check(*args, **kwargs)
        return Explanation(*selection.explain_lines(self.name, self.pinned, args, kwargs))

    def __repr__(self) -> str:
        pin = f", backend={','.join(self.pinned)!r}" if self.pinned else ""
        return f"OpHandle({self.name!r}{pin})"


_handles: dict[tuple[str, tuple[str, ...]], OpHandle] = {}


def op(name: str, backend: Union[None, str, Sequence[str]] = None) -> OpHandle:
    """A handle for op `name`; `backend` pins one backend (or a preference list) for this handle."""
    key = (name, selection.parse_backends(backend))
    handle = _handles.get(key)
    if handle is None:
        handle = _handles[key] = OpHandle(name, backend)
    return handle


def registered_backends(op_name: str) -> list[str]:
    """Every backend that declared or registered an implementation of the op, usable here or not."""
    name = TABLE.canonical(op_name)
    declared = set(TABLE.declaring_backends(name)) | {i.backend for i in TABLE.candidates(name)}
    return [b for b in TABLE.backend_names() if b in declared]


def backend_status(op_name: str, device: Union[str, torch.device], dtype: torch.dtype) -> dict[str, Optional[str]]:
    """For every registered backend: None when it can serve `op_name` on device/dtype, else the reason."""
    name = TABLE.canonical(op_name)
    device = torch.device(device)
    status: dict[str, Optional[str]] = {}
    if device.type == "cuda" and not torch.cuda.is_available():
        return {b: "no CUDA device on this machine" for b in registered_backends(name)}
    impls = TABLE.candidates(name)
    for backend in registered_backends(name):
        mine = [i for i in impls if i.backend == backend]
        if not mine:
            status[backend] = TABLE.unavailable_reason(name, backend)
            continue
        reasons = [i.capability.static_reason(device, (dtype,)) for i in mine]
        status[backend] = None if None in reasons else reasons[0]
    return status


def available_backends(op_name: str, device: Union[str, torch.device] = "cuda",
                       dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Backends that can serve the op on this device and dtype here, best first (reference last)."""
    name = TABLE.canonical(op_name)
    status = backend_status(name, device, dtype)
    best_first = dict.fromkeys(i.backend for i in TABLE.candidates(name))  # candidates are sorted by priority
    return reference_last([b for b in best_first if status.get(b, "") is None])
