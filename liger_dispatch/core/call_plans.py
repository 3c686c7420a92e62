"""A handle's repeated calls: what a call runs, remembered per call signature.

The first call of a signature takes the whole eager path: bind the arguments and validate them, the op's input
checks, autocast, selection (shape predicates, tuned tables, fallback), the value checks; it ends with a `Plan`:
the function that serves the call, which gradients it computes, and the fallback warning it gave, if any. A later
call with the same signature reuses the plan: it skips all of that but the steps that read the data or a setting
each call, which it runs as the first call did: the value checks (a label outside [0, V): on the device, or on the
host for CPU tensors and under LIGER_CHECKS=full) and a fallback's warning (once per reason) or, under
LIGER_STRICT, error. A noop-backend KL handle call: 18 -> 11 us of host time on the 2-core dev box.

The signature holds everything the skipped steps read:
- each argument, positional or by keyword name: a tensor's type, shape, strides, dtype, device and requires_grad;
  any other value's type and value (1, 1.0 and True are three signatures, as check_cache.py counts them);
- grad mode, and under autocast the autocast state of the call's device type;
- what selection reads besides the arguments: the backend preference (backend= on the handle; else use_backend,
  LIGER_BACKEND_<OP> and LIGER_BACKEND, read each call; under auto selection LIGER_TUNED_TABLE too), the op
  table's version (a backend registered since), and selection.generation (selection.reset() since).
So a capability's shape predicate must be a function of the signature (capability.py says so).

Not remembered: calls with a process_group (the vocab-parallel driver is made per call, after a collective),
calls whose signature cannot be hashed (an unhashable option) or read (a tensor without strides).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from liger_dispatch.core import autocast, selection
from liger_dispatch.settings import TUNED_TABLE, getenv
from liger_dispatch.core.table import TABLE

LIMIT = 1024  # signatures remembered per handle; past that they start over (a run whose shapes never repeat)


class Plan:
    """What the calls of one signature run: `fallback()` (the fallback's warning, or None when the selected
    implementation is the one asked for), then `launch(a, args, kwargs)`: the selected implementation, under the
    autograd.Function that computes the gradients the signature asks for (torch_ops.py)."""

    __slots__ = ("launch", "fallback")

    def __init__(self, launch: Callable, fallback: Optional[Callable[[], None]]):
        self.launch, self.fallback = launch, fallback


def _signature(values) -> tuple:
    """Each value's part of a call's signature (one comprehension, no call per value: this is the per-call path)."""
    return tuple([(type(v), v.shape, v.stride(), v.dtype, v.device, v.requires_grad) if isinstance(v, torch.Tensor)
                  else (type(v), v) for v in values])


class Plans:
    """One handle's plans by call signature."""

    __slots__ = ("spec", "pinned", "_cast_first", "_plans", "_generation")

    def __init__(self, spec, pinned: tuple[str, ...]):
        self.spec, self.pinned = spec, pinned
        # the parameter whose device says which autocast state applies (autocast.active reads the same one)
        self._cast_first = (spec.schema.positional.index(spec.autocast[0]), spec.autocast[0]) if spec.autocast else None
        self._plans: dict[tuple, Plan] = {}
        self._generation = selection.generation

    def lookup(self, args: tuple, kwargs: dict) -> tuple[Optional[Plan], Optional[tuple]]:
        """(the plan of this call's signature or None, the signature, or None when it cannot be remembered)."""
        if self._generation != selection.generation:
            self._plans.clear()
            self._generation = selection.generation
        try:
            key = (_signature(args), tuple(kwargs), _signature(kwargs.values()) if kwargs else (),
                   torch.is_grad_enabled(), autocast.enabled() and self._autocast_state(args, kwargs),
                   None if self.pinned else self._preference(), TABLE.version)
            return self._plans.get(key), key
        except (TypeError, RuntimeError, AttributeError, KeyError):  # unhashable, no strides, not a tensor, missing
            return None, None

    def remember(self, key: Optional[tuple], plan: Plan, process_group) -> None:
        if key is None or process_group is not None:
            return
        if len(self._plans) >= LIMIT:
            self._plans.clear()
        # under the table's version the plan was made at: the call's discovery may have registered backends since
        # the signature was read, and the next call reads this one
        self._plans[(*key[:-1], TABLE.version)] = plan

    def _preference(self):
        """What selection reads besides the arguments (a handle pinning backends reads none of it)."""
        preference = selection.preferences(self.spec.name, ())
        return preference if any(preference) else getenv(TUNED_TABLE.name)  # auto: the tuned tables order it

    def _autocast_state(self, args: tuple, kwargs: dict):
        """Under autocast: its state for the device of the call (an op with parameters it casts), else True."""
        if self._cast_first is None:
            return True
        index, name = self._cast_first
        value = args[index] if index < len(args) else kwargs[name]
        return autocast.state(value.device.type)
