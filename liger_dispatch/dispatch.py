"""The public entry points: `dispatch.op(name)`, `available_backends`, `registered_backends`."""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional, Sequence, Union

import torch

from liger_dispatch.core import autocast, calls, selection, torch_ops
from liger_dispatch.compose import vocab_parallel
from liger_dispatch.capability import default_device, default_dtype
from liger_dispatch.core.table import TABLE, Impl


class Explanation:
    """What `OpHandle.explain` returns: the implementation that would run, and why the others would not."""

    def __init__(self, impl: Optional[Impl], lines: list[str]):
        self.impl, self.lines = impl, lines
        self.backend = impl.backend if impl is not None else None

    def __str__(self) -> str:
        return "\n".join(self.lines)

    __repr__ = __str__


class OpHandle:
    """A callable for one op, optionally pinned to backends: binds and checks the arguments against the op's
    schema, then runs the selected implementation (eager), or calls torch.ops.liger_dispatch.<op> while
    torch.compile traces, whose implementation selects when it runs."""

    __slots__ = ("name", "pinned", "_spec", "_backend_arg", "_last")

    def __init__(self, name: str, backend: Union[None, str, Sequence[str]] = None):
        self.name = TABLE.canonical(name)
        self.pinned = selection.parse_backends(backend)
        selection.check_known(self.pinned, "backend= of dispatch.op")
        self._spec = TABLE.spec(self.name)
        self._backend_arg = ",".join(self.pinned) or None
        # (calls.epoch, key, plan) of the last call whose plan was remembered: a call of the same signature compares
        # its key with that one, not hashing it for the lookup (the call-signature cache holds the same plan)
        self._last: Optional[tuple] = None

    def _bound(self, args: tuple, kwargs: dict):
        """The bound arguments after the op's input checks (a call of a remembered signature skips this)."""
        a, args, kwargs = self._cast(self._spec.schema.bind(args, kwargs), args, kwargs)
        self._spec.check(a)
        return a, args, kwargs

    def _cast(self, a, args: tuple, kwargs: dict):
        if self._spec.autocast and autocast.active(self._spec, a):
            return autocast.cast(self._spec, a)
        return a, args, kwargs

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            a = self._bound(args, kwargs)[0]
            return self._result(a, torch_ops.call(self._spec, self._backend_arg, a))
        signature = calls.key(self._spec, self.pinned, args, kwargs)
        last = self._last
        if last is not None and last[0] == calls.epoch and last[1] == signature:
            plan = last[2]
        else:
            plan = calls.get(signature)
            if plan is None or plan.launch is None:
                return self._first_call(signature, args, kwargs)
            self._last = (calls.epoch, signature, plan)
        spec = self._spec
        a = spec.schema.rebind(args, kwargs)
        if autocast.enabled():
            a, args, kwargs = self._cast(a, args, kwargs)
            with autocast.disabled(a):
                calls.checked(spec, plan, a)
                return self._result(a, plan.launch(a, args, kwargs))
        calls.checked(spec, plan, a)  # the per-call path: _result written out
        outputs = plan.launch(a, args, kwargs)
        return outputs if spec.result is None else spec.result(a, outputs)

    def _result(self, a, outputs):
        """What the call returns: the op's outputs, or what its spec makes of them (OpSpec.result)."""
        return outputs if self._spec.result is None else self._spec.result(a, outputs)

    def _first_call(self, signature, args: tuple, kwargs: dict):
        """The whole eager path; its plan is remembered for the next call of the same signature (calls.py)."""
        a, args, kwargs = self._bound(args, kwargs)
        if self._spec.vocab_parallel is not None:  # a DTensor weight: its local slices
            a, args, kwargs = vocab_parallel.localized(self._spec, a, args, kwargs)
        # autocast off: the implementations' math is written for the dtypes they are given
        with autocast.disabled(a) if autocast.enabled() else contextlib.nullcontext():
            plan = torch_ops.plan(self._spec, self.pinned, a, args, kwargs)
            calls.remember(signature, plan, getattr(a, "process_group", None))
            return self._result(a, plan.launch(a, args, kwargs))

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
    name, device = TABLE.canonical(op_name), torch.device(device)
    backends = registered_backends(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        return {b: "no CUDA device on this machine" for b in backends}
    resolution = selection.resolve(name, (), device=device, dtypes=(dtype,), preferences_apply=False).resolution
    status = {r.backend: r.reason for r in reversed(resolution.rejected)}  # each backend's first reason
    status.update((i.backend, None) for i in resolution.chain)  # None: it can serve
    return {b: status.get(b, TABLE.unavailable_reason(name, b)) for b in backends}


def available_backends(op_name: str, device: Union[None, str, torch.device] = None,
                       dtype: Optional[torch.dtype] = None) -> list[str]:
    """Backends that can serve the op on this device and dtype here, best first (reference last): what auto
    selection chooses from (backend preferences do not apply). device defaults to this machine's
    (default_device()), dtype to default_dtype(device). Asking about CUDA on a machine without it warns: []."""
    name = TABLE.canonical(op_name)
    device = default_device() if device is None else torch.device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    if device.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(f"available_backends({op_name!r}, device={str(device)!r}): this machine has no CUDA device, "
                      "so no backend is available there", stacklevel=2)
        return []
    choice = selection.resolve(name, (), device=device, dtypes=(dtype,), preferences_apply=False)
    return list(dict.fromkeys(i.backend for i in choice.resolution.chain))
