"""What a call of each signature runs, remembered: the one call-signature cache (checks, selection, plan).

A signature's first call takes the whole path (bind and validate the arguments, input checks, autocast, selection, value
checks) and ends with a `Plan`: the function that serves the call and its fallback warning, if any. A later call of the
signature reuses the plan and runs only the steps that read the data or a setting each call: the value checks (a label
outside [0, V)) and the fallback's warning (once per reason) or, under LIGER_STRICT, error.

The machinery's own kernel-level ops (registry/support.py: the device label check, each gradient's scale in a loss's
backward, a mean's count in a composition) are selected once per signature of the call that runs them, which fixes their
arguments: a plan keeps them in `Kernels` by place (`keeping`) until the op table changes or selection.reset().

`key` holds everything the skipped steps read: the op, the pinned backends, each argument (a tensor's metadata, any
other value's type and value), grad mode, autocast state, the backend preference, the op table's version and
selection.generation; so a capability's shape predicate must be a function of the signature. Not remembered: calls with
a process_group (their driver is made per call, after a collective) or a signature that cannot be hashed or read.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional

import torch

from liger_dispatch.core import autocast, selection
from liger_dispatch.core.table import TABLE
from liger_dispatch.settings import TUNED_TABLE, getenv

LIMIT = 4096  # signatures remembered; past that they start over (a run whose shapes never repeat)
_VERSION = -2  # the table version's place in a key (the generation is last)
epoch = 0  # bumped whenever the plans are forgotten: a plan a handle kept for its last signature is forgotten too


class Kernels:
    """The machinery's kernel-level ops the calls of one signature run, by place: each selected on its first call and
    reused while the op table and selection.generation are unchanged; each call still warns and checks values."""

    __slots__ = ("made",)

    def __init__(self) -> None:
        self.made: dict = {}  # place -> (spec, plan, TABLE.version, selection.generation)

    def run(self, place, spec, args: tuple, kwargs: dict):
        made = self.made.get(place)
        if made is None or made[0] is not spec or made[2] != TABLE.version or made[3] != selection.generation:
            # the versions read after selecting: its discovery may have imported (and registered) backends
            made = self.made[place] = (spec, _kernel_plan(spec, (), args, kwargs), TABLE.version, selection.generation)
        plan = made[1]
        if plan.fallback is not None or spec.value_check is not None:
            checked(spec, plan, None if spec.value_check is None else spec.schema.bind(args, kwargs))
        return plan.fn(*args, **kwargs)


class Plan:
    """What the calls of one signature run: `fallback()` (None when the implementation asked for serves), then `fn` (the
    implementation, or the vocab-parallel driver on it) or, for a handle's eager call, `launch(a, args, kwargs)`
    (torch_ops.plan). `checks`: the machinery kernels its value checks run (None once they ran none)."""

    __slots__ = ("fn", "fallback", "launch", "backend", "checks")

    def __init__(self, fn: Callable, fallback: Optional[Callable[[], None]], backend: str):
        self.fn, self.fallback, self.backend, self.launch = fn, fallback, backend, None
        self.checks: Optional[Kernels] = Kernels()


_plans: dict[tuple, Plan] = {}


def key(spec, pinned: tuple[str, ...], args: tuple, kwargs: dict) -> Optional[tuple]:
    """The key of a call's plan, or None when the call cannot be remembered (1, 1.0 and True are three signatures).
    One comprehension over the positional then the keyword values (named by tuple(kwargs)): no call per value."""
    try:
        return (spec, pinned, tuple([(type(v), v.shape, v.stride(), v.dtype, v.device, v.requires_grad)
                                     if isinstance(v, torch.Tensor) else (type(v), v)
                                     for v in ((*args, *kwargs.values()) if kwargs else args)]), tuple(kwargs),
                torch.is_grad_enabled(), autocast.enabled() and _autocast_state(spec, args, kwargs),
                None if pinned else _preference(spec), TABLE.version_of(spec.name), selection.generation)
    except (RuntimeError, AttributeError, KeyError, IndexError):  # no strides, not a tensor, missing
        return None


def get(call_key: Optional[tuple]) -> Optional[Plan]:
    """The plan of a key, or None (also for a key that cannot be hashed: an unhashable option)."""
    try:
        return None if call_key is None else _plans.get(call_key)
    except TypeError:
        return None


def remember(call_key: Optional[tuple], plan: Plan, process_group=None) -> None:
    if call_key is None or process_group is not None:
        return
    if len(_plans) >= LIMIT:
        reset()
    # under the table's version after planning (the next call's key reads it): discovery may have registered backends
    with contextlib.suppress(TypeError):  # an unhashable option: not remembered
        _plans[(*call_key[:_VERSION], TABLE.version_of(call_key[0].name), call_key[-1])] = plan


def reset() -> None:
    """Forget every plan."""
    global epoch
    _plans.clear()
    epoch += 1


def _preference(spec):
    """What selection reads besides the arguments (an internal op's preferences are empty: selection.preferences)."""
    preference = selection.preferences(spec.name, ())
    return preference if any(preference) else getenv(TUNED_TABLE.name)  # auto: the tuned tables order it


def _autocast_state(spec, args: tuple, kwargs: dict):
    """Under autocast: its state for the device of the call (an op with parameters it casts), else True."""
    if not spec.autocast:
        return True
    name = spec.autocast[0]
    index = spec.schema.positional.index(name)
    value = args[index] if index < len(args) else kwargs[name]
    return autocast.state(value.device.type)


def _kernel_plan(spec, pinned: tuple[str, ...], args: tuple, kwargs: dict) -> Plan:
    call_key = key(spec, pinned, args, kwargs)
    plan = get(call_key)
    if plan is None:
        impl, fallback = selection.selected(spec.name, pinned, args, kwargs)
        plan = Plan(impl.fn, fallback, impl.backend)
        remember(call_key, plan)
    return plan


def kernel(spec, pinned: tuple[str, ...], args: tuple, kwargs: dict) -> Callable:
    """This kernel-level call's implementation (its signature's plan), after its fallback warning and value checks."""
    plan = _kernel_plan(spec, pinned, args, kwargs)
    checked(spec, plan, None if spec.value_check is None else spec.schema.bind(args, kwargs))
    return plan.fn


_checking = threading.local()  # .at: [the Kernels of the plan whose value checks run now on this thread, places used]


def checked(spec, plan: Plan, a) -> None:
    """What every call of plan's signature runs: its fallback's warning (or strict error), then spec's value checks
    of the bound arguments `a`, the machinery kernels they run kept in the plan."""
    if plan.fallback is not None:
        plan.fallback()
    if spec.value_check is None:
        return
    kernels = plan.checks
    if kernels is None:
        spec.value_check(a)
        return
    previous = getattr(_checking, "at", None)
    _checking.at = [kernels, 0]
    try:
        spec.value_check(a)
    finally:
        _checking.at = previous
    if not kernels.made:  # none ran: the later calls need no place for them (one that runs one selects it per call)
        plan.checks = None


def keeping(fn: Callable, kernels: Kernels) -> Callable:
    """fn, with the machinery kernels it runs (a composition's valid_rows) kept in `kernels` by place, as a plan's
    value checks keep theirs: the composition of one signature runs the same ones in the same order."""

    def run(*args, **kwargs):
        previous = getattr(_checking, "at", None)
        _checking.at = [kernels, 0]
        try:
            return fn(*args, **kwargs)
        finally:
            _checking.at = previous

    return run


def machinery(spec, args: tuple, kwargs: dict):
    """Run one of the machinery's own kernel-level ops (registry/support.py): within a plan's value checks or its
    implementation (`keeping`), the kernel that plan keeps for this place; elsewhere, its own signature's plan."""
    at = getattr(_checking, "at", None)
    if at is None:
        return kernel(spec, (), args, kwargs)(*args, **kwargs)
    kernels, place = at
    at[1] = place + 1
    return kernels.run(place, spec, args, kwargs)
