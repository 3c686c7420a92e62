"""The public entry points: `dispatch.op(name)`, `available_backends`, `registered_backends`."""

from __future__ import annotations

import warnings
from typing import Optional, Sequence, Union

import torch

from liger_dispatch.core import autocast, call_plans, check_cache, discovery, selection, torch_ops
from liger_dispatch.compose import vocab_parallel
from liger_dispatch.capability import default_device, default_dtype
from liger_dispatch.core.table import TABLE, Impl, reference_last


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
    """A callable for one op, optionally pinned to backends: binds and checks the arguments against the op's
    schema, then runs the selected implementation (eager), or calls torch.ops.liger_dispatch.<op> while
    torch.compile traces, whose implementation selects when it runs."""

    __slots__ = ("name", "pinned", "_spec", "_backend_arg", "_vocab_parallel", "_plans")

    def __init__(self, name: str, backend: Union[None, str, Sequence[str]] = None):
        self.name = TABLE.canonical(name)
        self.pinned = selection.parse_backends(backend)
        self._spec = TABLE.spec(self.name)
        self._backend_arg = ",".join(self.pinned) or None
        self._vocab_parallel = self._spec.vocab_parallel is not None  # a DTensor weight: its local slices
        self._plans = call_plans.Plans(self._spec, self.pinned)

    def _bound(self, args: tuple, kwargs: dict, tracing: bool = False):
        a, args, kwargs = self._cast(self._spec.schema.bind(args, kwargs), args, kwargs)
        if tracing:  # fake tensors, maybe symbolic sizes: the check is traced, not memoized
            self._spec.check(a)
        else:
            check_cache.check(self._spec, a)
        return a, args, kwargs

    def _cast(self, a, args: tuple, kwargs: dict):
        if self._spec.autocast and autocast.active(self._spec, a):
            return autocast.cast(self._spec, a)
        return a, args, kwargs

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return torch_ops.call(self._spec, self._backend_arg, self._bound(args, kwargs, tracing=True)[0])
        plan, signature = self._plans.lookup(args, kwargs)
        if plan is None:
            return self._first_call(signature, args, kwargs)
        a = self._spec.schema.rebind(args, kwargs)
        if not autocast.enabled():
            return torch_ops.replay(self._spec, plan, a, args, kwargs)
        a, args, kwargs = self._cast(a, args, kwargs)
        with autocast.disabled(a):
            return torch_ops.replay(self._spec, plan, a, args, kwargs)

    def _first_call(self, signature, args: tuple, kwargs: dict):
        """The whole eager path; its plan is remembered for the next call of the same signature (call_plans.py)."""
        a, args, kwargs = self._bound(args, kwargs)
        if self._vocab_parallel:
            a, args, kwargs = vocab_parallel.localized(self._spec, a, args, kwargs)
        plan = _autocast_off(a, torch_ops.plan, self._spec, self.pinned, a, args, kwargs)
        self._plans.remember(signature, plan, getattr(a, "process_group", None))
        return _autocast_off(a, plan.launch, a, args, kwargs)

    def select(self, *args, **kwargs) -> Impl:
        """The implementation that would serve this call (with the same warnings a call would give)."""
        _, args, kwargs = self._bound(args, kwargs)
        return selection.select(self.name, self.pinned, args, kwargs)

    def explain(self, *args, **kwargs) -> Explanation:
        _, args, kwargs = self._bound(args, kwargs)
        return Explanation(*selection.explain_lines(self.name, self.pinned, args, kwargs))

    def __repr__(self) -> str:
        pin = f", backend={','.join(self.pinned)!r}" if self.pinned else ""
        return f"OpHandle({self.name!r}{pin})"


def _autocast_off(a, fn, *args):
    """fn(*args) with autocast off: the implementations' math is written for the dtypes they are given."""
    if not autocast.enabled():
        return fn(*args)
    with autocast.disabled(a):
        return fn(*args)


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
        status[backend] = discovery.out_of_reach(backend, device.type)
        if status[backend] is not None:
            continue
        if not mine:
            status[backend] = TABLE.unavailable_reason(name, backend)
            continue
        reasons = [i.capability.static_reason(device, (dtype,)) for i in mine]
        status[backend] = None if None in reasons else reasons[0]
    return status


def available_backends(op_name: str, device: Union[None, str, torch.device] = None,
                       dtype: Optional[torch.dtype] = None) -> list[str]:
    """Backends that can serve the op on this device and dtype here, best first (reference last).

    device defaults to this machine's (CUDA when it has one, else the CPU), dtype to bf16 on CUDA and fp32 on the
    CPU. Asking about CUDA on a machine without it warns, and the answer is [].
    """
    name = TABLE.canonical(op_name)
    device = default_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    if device.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"available_backends({op_name!r}, device={str(device)!r}): this machine has no CUDA device, "
                      "so no backend is available there", stacklevel=2)
    status = backend_status(name, device, dtype)
    best_first = dict.fromkeys(i.backend for i in TABLE.candidates(name))  # candidates are sorted by priority
    return reference_last([b for b in best_first if status.get(b, "") is None])
