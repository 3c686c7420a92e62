"""An op's input check, run once per call signature: a repeated call skips it.

An op's `check` reads tensor metadata and option values only (OpSpec.check: it also runs while torch.compile traces
fake tensors), so whether it passes is a function of the call's signature: every tensor's shape, strides, dtype and
device, and every other argument's type and value, in the schema's order. A signature seen to pass is remembered;
any other call runs the check, so a bad call raises the same error every time. The signature costs about a
microsecond for a loss op; the checks it skips cost ten.
"""

from __future__ import annotations

import operator

import torch

from liger_dispatch.core.schema import Args

LIMIT = 4096  # signatures remembered; past that the set starts over (a run whose shapes never repeat)

_passed: set[tuple] = set()
_readers: dict = {}  # OpSpec -> (getter of its tensor arguments, getter of the others), in schema order


def _getter(names: tuple):
    """names' values of a dict as a tuple, in C (one name included)."""
    if len(names) == 1:
        return lambda values: (values[names[0]],)
    return operator.itemgetter(*names) if names else lambda values: ()


def _reader(spec):
    reader = _readers.get(spec)
    if reader is None:
        tensors = tuple(p.name for p in spec.schema.params if p.is_tensor)
        others = tuple(p.name for p in spec.schema.params if not p.is_tensor)
        reader = _readers[spec] = (_getter(tensors), _getter(others))
    return reader


def signature(spec, a: Args) -> tuple:
    """What spec.check(a) can read, hashable: the options' values and their types (1 and 1.0 and True are equal
    keys, but not equal to every check), then each tensor argument's (shape, strides, dtype, device)."""
    tensors, others = _reader(spec)
    values = a.__dict__
    options = others(values)
    return (spec, options, tuple(map(type, options)),
            *[(t.shape, t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t), t)
              for t in tensors(values)])


def check(spec, a: Args) -> None:
    """spec.check(a), unless a call of the same signature passed it before."""
    try:
        key = signature(spec, a)
        seen = key in _passed
    except (TypeError, RuntimeError):  # an unhashable option, symbolic sizes, a layout without strides
        spec.check(a)
        return
    if not seen:
        spec.check(a)
        if len(_passed) >= LIMIT:
            _passed.clear()
        _passed.add(key)


def reset() -> None:
    """Forget every remembered signature (tests)."""
    _passed.clear()
