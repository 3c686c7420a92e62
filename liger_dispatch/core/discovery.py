"""Which backends a call can reach, so that discovery imports only their modules.

Each in-tree backend declares the device types it can ever accept (registry/__init__.py): a call on tensors of
another device type never imports its modules, so never its DSL (triton, helion, cutlass), and choosing the
reference over it is no fallback. A backend that declares nothing is imported whenever an op it serves is resolved.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from liger_dispatch.capability import device_reason

_devices: dict[str, Callable[[], Sequence[str]]] = {}
_hints: dict[str, str] = {}


def declare_backend_devices(backend: str, devices: Callable[[], Sequence[str]], hint: str = "") -> None:
    """`backend` can only ever accept tensors of the device types `devices()` returns (empty: any). It is called
    on each resolution, so it may follow an environment variable; `hint` says how to reach the others."""
    _devices[backend] = devices
    _hints[backend] = hint


def out_of_reach(backend: str, device_type: str) -> Optional[str]:
    """Why `backend` can never serve tensors of `device_type`, or None when it may (or declared nothing)."""
    devices = _devices.get(backend)
    reason = device_reason(tuple(devices()), device_type) if devices is not None else None
    if reason is not None and _hints.get(backend):
        reason += f" ({_hints[backend]})"
    return reason
