"""What an implementation returns, checked against its op's fake on a plan's first call (calls.py): how many
outputs, each one's shape, dtype and device, and those of every kernel-level op a composition calls meanwhile; a
mismatch is a BackendError naming the op, the backend and what differs. Later calls are not checked.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

from liger_dispatch.errors import BackendError

_state = threading.local()


class Like:
    """Stands for a tensor an implementation must return: its shape, dtype and device."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, shape, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device


def active() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def checking():
    previous = active()
    _state.on = True
    try:
        yield
    finally:
        _state.on = previous


def _meta(t) -> tuple:
    return tuple(t.shape), t.dtype, torch.device(t.device)


def _show(meta) -> str:
    shape, dtype, device = meta
    return f"a {str(dtype).replace('torch.', '')} tensor of shape {list(shape)} on {device}"


def mismatch(expected, got) -> Optional[str]:
    """What differs between the expected outputs (a tensor or Like, None, or a tuple of them) and what an
    implementation returned, or None."""
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)):
            return f"returned {type(got).__name__} where the op returns {len(expected)} outputs"
        if len(got) != len(expected):
            return f"returned {len(got)} outputs, the op returns {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            why = mismatch(e, g)
            if why is not None:
                return f"output {i}: {why}"
        return None
    if expected is None:
        return None if got is None else f"returned {type(got).__name__} where the op returns nothing"
    want = _meta(expected)
    if not isinstance(got, torch.Tensor):
        return f"returned {type(got).__name__} where the op returns {_show(want)}"
    have = _meta(got)
    return None if have == want else f"returned {_show(have)} where the op returns {_show(want)}"


def check(op: str, backend: str, expected, got) -> None:
    why = mismatch(expected, got)
    if why is not None:
        raise BackendError(f"{backend}'s implementation of {op} {why} (checked against the op's fake on the first "
                           "call of each signature)")
