"""Which implementation serves a call: preferences, capability and fallback in one function, `resolve`, that
every caller asks; what a call of one signature resolved to is remembered by calls.py.

The first preference set wins: `backend=` on the handle; `use_backend(...)`; LIGER_BACKEND_<OP>; LIGER_BACKEND;
else auto (the backends a tuned table measured fastest here first (tuned.py), then best priority). A requested
backend that cannot serve yields to the next and finally to the reference, with one FallbackWarning per (op,
backend, reason); LIGER_STRICT=1 makes that an error. In auto mode the reference is no fallback when no other
backend accepts the call's device type at all (CPU tensors without the Triton interpreter, say).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from liger_dispatch.core import discovery
from liger_dispatch import settings
from liger_dispatch.tuning import tuned
from liger_dispatch.capability import dtype_name
from liger_dispatch.errors import (BackendUnavailableError, FallbackWarning, LigerDispatchError, UnknownBackendError,
                                   warn_at_caller)
from liger_dispatch.settings import getenv
from liger_dispatch.core.table import REFERENCE, TABLE, Impl

_local = threading.local()
_warned: set[tuple[str, str, str]] = set()
generation = 0  # bumped by reset(): the plans remembered of earlier selections (calls.py) start over


def parse_backends(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(v.strip() for v in value if v and v.strip())


@contextlib.contextmanager
def use_backend(*backends: str) -> Iterator[None]:
    """Prefer these backends (in order) for every op called in this thread inside the block."""
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(parse_backends(backends[0] if len(backends) == 1 else backends))
    try:
        yield
    finally:
        stack.pop()


@functools.lru_cache(maxsize=None)
def env_key(op: str) -> str:
    return "LIGER_BACKEND_" + "".join(c if c.isalnum() else "_" for c in op.upper())


def preference(op: str, pinned: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """(where the preference came from, the backend names) of the first of `preferences` that is set (a
    use_backend() block even when it names none), or ("auto", ())."""
    sources = ("backend= on the handle", "use_backend()", env_key(op), "LIGER_BACKEND")
    for source, value in zip(sources, preferences(op, pinned or None)):
        if value not in (None, ""):
            return source, parse_backends(value)
    return "auto", ()


def strict() -> bool:
    return settings.STRICT.get()


@dataclass(frozen=True)
class Rejection:
    backend: str
    variant: str
    reason: str
    wrong_device: bool = False  # the backend never accepts the call's device type


@dataclass(frozen=True)
class Resolution:
    """The statically capable implementations in the order they are tried, and what was turned down."""

    op: str
    source: str
    requested: tuple[str, ...]
    chain: tuple[Impl, ...]
    rejected: tuple[Rejection, ...]
    tuned: Optional[tuned.Entry] = None  # the measured entry that ordered an auto chain


def check_known(names: Sequence[str], source: str) -> None:
    known = TABLE.backend_names()
    for name in names:
        if name not in known:
            raise UnknownBackendError(
                f"unknown backend '{name}' (from {source}); registered backends: {', '.join(known)}")


def _static(op: str, pinned: tuple[str, ...], device: torch.device, dtypes: tuple, tuned_key,
            preferences_apply: bool) -> Resolution:
    """The Resolution of a call: what depends only on its signature."""
    source, requested = preference(op, pinned) if preferences_apply else ("auto", ())
    check_known(requested, source)
    settings.check_all()
    unreachable = {b: r for b in TABLE.backend_names() if (r := discovery.out_of_reach(b, device.type))}
    reachable = [b for b in TABLE.declaring_backends(op) if b not in unreachable]
    candidates = TABLE.candidates(op, reachable)  # after discovering their modules
    rejected, capable = [], []
    for impl in candidates:
        reason = unreachable.get(impl.backend) or impl.capability.static_reason(device, dtypes)
        if reason is None:
            capable.append(impl)
        else:
            wrong_device = impl.backend in unreachable or not impl.capability.accepts_device_type(device.type)
            rejected.append(Rejection(impl.backend, impl.variant, reason, wrong_device))
    have = {i.backend for i in candidates}
    for name in requested or TABLE.declaring_backends(op):
        if name not in have:
            reason = unreachable.get(name) or TABLE.unavailable_reason(op, name)
            rejected.append(Rejection(name, "", reason, name in unreachable))
    entry = None
    if requested:
        order = [i for name in requested for i in capable if i.backend == name]
        order += [i for i in capable if i.backend == REFERENCE and i not in order]
    else:
        order, entry = tuned.measured_first(capable, tuned.choice(op, device, dtypes, tuned_key), lambda i: i.backend)
        order = [i for i in order if i.backend != REFERENCE] + [i for i in order if i.backend == REFERENCE]
    return Resolution(op, source, requested, tuple(order), tuple(rejected), entry)


def preferences(op: str, pinned: tuple[str, ...]) -> tuple:
    """(pinned, use_backend's innermost, LIGER_BACKEND_<OP>, LIGER_BACKEND) as they are now, unparsed (a cache
    key's part; preference() parses the one that wins)."""
    if TABLE.spec(op).internal:
        return ()
    stack = getattr(_local, "stack", None)
    return pinned, stack[-1] if stack else None, getenv(env_key(op)), getenv("LIGER_BACKEND")


@dataclass(frozen=True)
class Choice:
    """What `resolve` found: the implementation that serves (None: nothing can), the statically resolved chain,
    and the implementations a shape predicate turned down for this call."""

    resolution: Resolution
    impl: Optional[Impl]
    late: tuple[Rejection, ...] = ()
    device: Optional[torch.device] = None
    dtypes: tuple = ()
    tuned_key: object = None

    @property
    def rejected(self) -> tuple[Rejection, ...]:
        return (*self.resolution.rejected, *self.late)

    @property
    def is_fallback(self) -> bool:
        """A requested backend did not serve, or (auto) the reference serves though another accepts the device type."""
        if self.impl is None:
            return False
        if self.resolution.requested:
            return self.impl.backend != self.resolution.requested[0]
        return self.impl.backend == REFERENCE and any(_better(r) for r in self.rejected)


def resolve(op: str, pinned: tuple[str, ...], args=None, kwargs=None, *, device: Optional[torch.device] = None,
            dtypes: Optional[tuple] = None, preferences_apply: bool = True) -> Choice:
    """With a call's args/kwargs: what serves that call (shape predicates judged). Without them: what serves calls
    on `device` with floating `dtypes` (the predicates not asked)."""
    call = args is not None
    if call:  # the device of the call's first tensor; the floating dtypes, which capabilities check
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        dtypes = tuple(dict.fromkeys(t.dtype for t in tensors if t.dtype.is_floating_point))
        tuned_key = None if (preferences_apply and any(preferences(op, pinned))) else tuned.lookup_key(
            op, device, args, kwargs)
    else:
        dtypes, tuned_key = tuple(dtypes or ()), None
    res = _static(op, pinned, device, dtypes, tuned_key, preferences_apply)
    late = []
    for impl in res.chain:  # usually the first serves
        predicate = impl.capability.predicate if call else None  # returns why it turns the call down, or None
        try:
            reason = None if predicate is None else predicate(*args, **kwargs)
        except Exception as exc:  # a broken predicate rejects its own implementation, never the call
            reason = f"its capability predicate raised {type(exc).__name__}: {exc}".splitlines()[0]
        if reason is None:
            return Choice(res, impl, tuple(late), device, dtypes, tuned_key)
        late.append(Rejection(impl.backend, impl.variant, reason))
    return Choice(res, None, tuple(late), device, dtypes, tuned_key)


def selected(op: str, pinned: tuple[str, ...], args, kwargs) -> tuple[Impl, Optional[Callable[[], None]]]:
    """The implementation that serves this call, and what warns about its fallback once per reason or raises under
    LIGER_STRICT (None: no fallback), uncalled so that a repeated call can replay it (calls.py)."""
    choice = resolve(op, pinned, args, kwargs)
    if choice.impl is None:
        raise LigerDispatchError(f"{op}: no backend can serve this call: " + _describe(choice.rejected))
    if not choice.is_fallback:
        return choice.impl, None
    return choice.impl, functools.partial(_fallback, choice.resolution, choice.impl, choice.rejected)


def select(op: str, pinned: tuple[str, ...], args, kwargs) -> Impl:
    """The implementation that serves this call (warning or raising on fallback)."""
    impl, fallback = selected(op, pinned, args, kwargs)
    if fallback is not None:
        fallback()
    return impl


def _better(rejection: Rejection) -> bool:
    """A backend other than the reference that could have served calls on this device type."""
    return rejection.backend != REFERENCE and not rejection.wrong_device


def _describe(rejected: Sequence[Rejection]) -> str:
    return "; ".join(f"{r.backend}: {r.reason}" for r in rejected)


def _fallback(res: Resolution, chosen: Impl, rejected: Sequence[Rejection]) -> None:
    wanted = res.requested[: res.requested.index(chosen.backend)] if chosen.backend in res.requested else res.requested
    relevant = [r for r in rejected if (r.backend in wanted if res.requested else _better(r))]
    why = _describe(relevant) or "no reason recorded"
    message = (f"requested {', '.join(wanted)} (from {res.source}) cannot serve this call" if res.requested
               else "no backend other than the reference can serve this call")
    if strict():
        raise BackendUnavailableError(f"liger_dispatch: {res.op}: {message} [{why}]; {settings.STRICT.name} is set, "
                                      f"so this is an error instead of a fallback to '{chosen.backend}'")
    message = f"liger_dispatch: {res.op}: {message} [{why}]; falling back to '{chosen.backend}'"
    key = (res.op, ",".join(r.backend for r in relevant), why)
    if key not in _warned:
        _warned.add(key)
        warn_at_caller(message, FallbackWarning)


def reset() -> None:
    """Forget emitted warnings and the plans made from earlier selections (tests, or after changing the environment)."""
    global generation
    _warned.clear()
    tuned.reset()
    generation += 1


def explain_lines(op: str, pinned: tuple[str, ...], args, kwargs) -> tuple[Optional[Impl], list[str]]:
    """Which implementation would serve this call and why each other one would not; no side effects."""
    choice = resolve(op, pinned, args, kwargs)
    res, chosen = choice.resolution, choice.impl
    lines = [f"op {op} on {choice.device} ({', '.join(dtype_name(d) for d in choice.dtypes) or 'no float tensors'}); "
             f"preference: {res.source}" + (f" = {', '.join(res.requested)}" if res.requested else "")]
    late = {(r.backend, r.variant): r.reason for r in choice.late}
    for impl in res.chain:
        label = f"{impl.backend} [{impl.variant}]"
        reason = late.get((impl.backend, impl.variant))
        if reason is not None:
            lines.append(f"  {label}: cannot serve: {reason}")
        elif impl is chosen:
            measured = dict(res.tuned.ms) if res.tuned is not None else {}
            why = (f"tuned: {measured[impl.backend]:.3g} ms measured" if impl.backend in measured
                   else f"priority {impl.priority}")
            lines.append(f"  {label}: SELECTED ({why})")
        elif chosen is not None:
            lines.append(f"  {label}: capable, not chosen (after {chosen.backend}, priority {impl.priority})")
    for r in res.rejected:
        lines.append(f"  {r.backend}" + (f" [{r.variant}]" if r.variant else "") + f": cannot serve: {r.reason}")
    if not res.requested:
        lines += tuned.explain(op, choice.device, choice.dtypes, choice.tuned_key, res.tuned)
    if choice.is_fallback:
        lines.append(f"  -> a fallback to {chosen.backend}: warns once per reason, raises under LIGER_STRICT=1")
    return chosen, lines
