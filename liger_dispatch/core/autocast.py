"""torch.autocast for the fused-linear ops: they replace an `F.linear`, so they cast as autocast casts a linear layer.

Their linear operands (OpSpec.autocast) are cast to the autocast dtype before the checks (an fp32 master weight
with a bf16 activation is the usual case); autograd brings each gradient back in its parameter's own dtype. The
implementations then run with autocast off: their math is written for the dtypes they are given.
"""

from __future__ import annotations

import torch

from liger_dispatch.core.schema import Args


def _device_type(spec, a: Args) -> str:
    return getattr(a, spec.autocast[0]).device.type


# enabled(): autocast is on for some device type (asked on every op call: torch's C function itself, no wrapper)
enabled = torch._C._is_any_autocast_enabled


def active(spec, a: Args) -> bool:
    return enabled() and torch.is_autocast_enabled(_device_type(spec, a))


def state(device_type: str) -> tuple[bool, torch.dtype]:
    """Whether autocast casts a call on `device_type` tensors, and to what (part of a repeated call's signature)."""
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def cast(spec, a: Args) -> tuple[Args, tuple, dict]:
    """The call with its linear operands in the autocast dtype: (bound arguments, positional, keyword)."""
    dtype = torch.get_autocast_dtype(_device_type(spec, a))
    values = {name: getattr(a, name) for name in spec.schema.names}  # getattr: torch.compile traces this
    for name in spec.autocast:
        if isinstance(values[name], torch.Tensor) and values[name].is_floating_point():
            values[name] = values[name].to(dtype)
    cast_args = Args(values)
    return (cast_args, *spec.schema.call_args(cast_args))


def disabled(a: Args):
    """A context that turns autocast off for the implementation (called when it is on)."""
    device_type = next(v.device.type for v in vars(a).values() if isinstance(v, torch.Tensor))
    return torch.autocast(device_type, enabled=False)
