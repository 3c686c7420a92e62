"""What a backend implementation can serve, checked against the tensors of each call."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

_CC_CACHE: dict[int, tuple[int, int]] = {}
# the device types a Capability may name: torch's own (a typo such as "gpu" is an error at registration)
DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "mtia", "privateuseone")


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """Compute capability of a CUDA device (cached), None for other device types."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = _CC_CACHE.get(index)
    if cc is None:
        cc = _CC_CACHE[index] = torch.cuda.get_device_capability(index)
    return cc


def default_device() -> torch.device:
    """The device a question about "here" is about: CUDA when this machine has one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """What training runs in on that device: bf16 on CUDA, fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _module_missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def device_reason(devices: Sequence[str], device_type: str) -> Optional[str]:
    """Why an implementation accepting tensors on `devices` (empty: any) turns down `device_type` ones, or None."""
    if not devices or device_type in devices:
        return None
    if device_type == "cpu" and "cuda" in devices:
        return f"needs a CUDA device, got {device_type} tensors"
    return f"needs a {'/'.join(devices)} device, got {device_type} tensors"


@dataclass(frozen=True)
class Capability:
    """Where an implementation runs.

    devices: device types it accepts ("cuda", "cpu", ...); empty means any.
    min_cc / max_cc: compute-capability bounds for CUDA inputs, read off the inputs' own device.
    dtypes: accepted dtypes of every floating-point tensor argument; None means any.
    modules: importable modules it needs.
    predicate: called with the op's arguments; returns why the call is out of reach (a shape limit, say), or None.
        It must read only what a call's signature holds (shapes, strides, dtypes, devices, option values:
        core/calls.py): it is asked on a signature's first call, and repeated calls reuse the answer.
    """

    devices: Sequence[str] = ()
    min_cc: Optional[tuple[int, int]] = None
    max_cc: Optional[tuple[int, int]] = None
    dtypes: Optional[Sequence[torch.dtype]] = None
    modules: Sequence[str] = ()
    predicate: Optional[Callable[..., Optional[str]]] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.devices, str) or isinstance(self.modules, str):
            raise ValueError("Capability(devices=..., modules=...) take sequences of names, not one string")
        for device in self.devices:
            if device not in DEVICE_TYPES:
                raise ValueError(f"Capability(devices=...): {device!r} is not a device type; expected some of "
                                 f"{', '.join(DEVICE_TYPES)}")
        for dtype in self.dtypes or ():
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"Capability(dtypes=...): {dtype!r} is not a torch.dtype (torch.bfloat16, ...)")
        for bound in (self.min_cc, self.max_cc):
            if bound is not None and (len(tuple(bound)) != 2 or not all(isinstance(v, int) for v in bound)):
                raise ValueError(f"Capability(min_cc/max_cc=...): {bound!r} is not a (major, minor) pair of ints")

    def accepts_device_type(self, device_type: str) -> bool:
        return device_reason(self.devices, device_type) is None

    def static_reason(self, device: torch.device, dtypes: Sequence[torch.dtype]) -> Optional[str]:
        """Why this capability rejects calls on `device` with these floating dtypes, or None."""
        reason = device_reason(self.devices, device.type)
        if reason is not None:
            return reason
        cc = device_capability(device)
        if cc is not None:
            if self.min_cc is not None and cc < tuple(self.min_cc):
                return f"needs compute capability >= {self.min_cc[0]}.{self.min_cc[1]}, device has {cc[0]}.{cc[1]}"
            if self.max_cc is not None and cc > tuple(self.max_cc):
                return f"needs compute capability <= {self.max_cc[0]}.{self.max_cc[1]}, device has {cc[0]}.{cc[1]}"
        for dtype in dtypes:
            if self.dtypes is not None and dtype not in self.dtypes:
                return f"does not support {dtype_name(dtype)} (supports {', '.join(map(dtype_name, self.dtypes))})"
        missing = next((m for m in self.modules if _module_missing(m)), None)
        return None if missing is None else f"module '{missing}' is not installed"
