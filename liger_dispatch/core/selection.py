"""Which implementation serves a call: preferences, capability, fallback, memoization.

Order, first source that is set wins: `backend=` on the handle; `use_backend(...)`;
LIGER_BACKEND_<OP>; LIGER_BACKEND; otherwise auto (best priority among the capable, after the backends a tuned
table for this device measured fastest: tuned.py).
A requested backend that cannot serve yields to the next preference and finally to the reference,
with one FallbackWarning per (op, backend, reason); LIGER_STRICT=1 makes that an error. In auto mode the
reference is no fallback when no other backend accepts the call's device type at all (CPU tensors on a
machine without the Triton interpreter, say).
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
from liger_dispatch.core.table import REFERENCE, TABLE, Impl, reference_last

_local = threading.local()
_warned: set[tuple[str, str, str]] = set()
_memo: dict[tuple, "Resolution"] = {}
_MEMO_LIMIT = 4096
generation = 0  # bumped by reset(): what was remembered of earlier selections (call_plans.py) starts over


def parse_backends(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(v.strip() for v in value if v and v.strip())


@contextlib.contextmanager
def use_backend(*backends: str) -> Iterator[None]:
    """Prefer these backends (in order) for every op called in this thread inside the block."""
    names = parse_backends(backends[0] if len(backends) == 1 else backends)
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(names)
    try:
        yield
    finally:
        stack.pop()


@functools.lru_cache(maxsize=None)
def env_key(op: str) -> str:
    return "LIGER_BACKEND_" + "".join(c if c.isalnum() else "_" for c in op.upper())


def preference(op: str, pinned: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """(where the preference came from, the backend names), or ("auto", ()) when none is set (or applies)."""
    if TABLE.spec(op).internal:
        return "auto", ()
    if pinned:
        return "backend= on the handle", pinned
    stack = getattr(_local, "stack", None)
    if stack:
        return "use_backend()", stack[-1]
    value = getenv(env_key(op))
    if value:
        return env_key(op), parse_backends(value)
    value = getenv("LIGER_BACKEND")
    if value:
        return "LIGER_BACKEND", parse_backends(value)
    return "auto", ()


def strict() -> bool:
    return settings.STRICT.get()


def call_signature(args: Sequence, kwargs: dict) -> tuple[torch.device, tuple[torch.dtype, ...]]:
    """The device of the call's first tensor and the dtype of every tensor, in order (one pass, hot path)."""
    device = None
    dtypes = []
    for values in (args, kwargs.values()):
        for value in values:
            if isinstance(value, torch.Tensor):
                device = device or value.device
                dtypes.append(value.dtype)
    return device or torch.device("cpu"), tuple(dtypes)


def _floating(dtypes: tuple) -> tuple:
    """The distinct floating-point dtypes: what a Capability's dtypes are checked against."""
    return tuple(dict.fromkeys(d for d in dtypes if d.is_floating_point))


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
    version: int  # TABLE.version the candidates were read at, after this call's discovery
    tuned: Optional[tuned.Entry] = None  # the measured entry that ordered an auto chain


def _check_known(names: Sequence[str], source: str) -> None:
    known = TABLE.backend_names()
    for name in names:
        if name not in known:
            raise UnknownBackendError(
                f"unknown backend '{name}' (from {source}); registered backends: {', '.join(known)}")


def resolve_static(op: str, pinned: tuple[str, ...], device: torch.device, dtypes: tuple,
                   tuned_key=None) -> Resolution:
    """The memoizable part of selection: everything that depends only on the call's signature (and, where a
    tuned table applies, its shape bucket: tuned_key)."""
    source, requested = preference(op, pinned)
    _check_known(requested, source)
    settings.check_all()
    unreachable = {b: r for b in TABLE.backend_names() if (r := discovery.out_of_reach(b, device.type))}
    reachable = [b for b in TABLE.declaring_backends(op) if b not in unreachable]
    TABLE.discover(op, reachable)  # imports backend modules, which register: TABLE.version moves
    version = TABLE.version
    candidates = TABLE.candidates(op, reachable)
    rejected: list[Rejection] = []
    capable: list[Impl] = []
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
        order = reference_last(order, lambda i: i.backend)
    return Resolution(op, source, requested, tuple(order), tuple(rejected), version, entry)


def preferences(op: str, pinned: tuple[str, ...]) -> tuple:
    """Where a call's backend preference is read from, as read now: (pinned, use_backend's innermost,
    LIGER_BACKEND_<OP>, LIGER_BACKEND); a memo key's part (unparsed: preference() parses the one that wins)."""
    stack = getattr(_local, "stack", None)
    return pinned, stack[-1] if stack else None, getenv(env_key(op)), getenv("LIGER_BACKEND")


def _resolution(op: str, pinned: tuple[str, ...], args, kwargs) -> Resolution:
    device, dtypes = call_signature(args, kwargs)
    preferred = preferences(op, pinned)
    # the tables order auto selection only: a call with a preference skips the bucket lookup
    tuned_key = None if any(preferred) else tuned.lookup_key(op, device, args, kwargs)
    key = (op, *preferred, device, dtypes, tuned_key, TABLE.version)
    res = _memo.get(key)
    if res is None:
        res = resolve_static(op, pinned, device, _floating(dtypes), tuned_key)
        if len(_memo) >= _MEMO_LIMIT:
            _memo.clear()
        # stored under the version its candidates were read at: after this call's discovery, which may have
        # registered backends (the key's version was read before it), so the next call finds it
        _memo[(*key[:-1], res.version)] = res
    return res


def select(op: str, pinned: tuple[str, ...], args, kwargs) -> Impl:
    """The implementation that serves this call (warning or raising on fallback)."""
    impl, fallback = selected(op, pinned, args, kwargs)
    if fallback is not None:
        fallback()
    return impl


def selected(op: str, pinned: tuple[str, ...], args, kwargs) -> tuple[Impl, Optional[Callable[[], None]]]:
    """The implementation that serves this call, and, when it is a fallback, what warns about it (once per reason)
    or raises under LIGER_STRICT: not called yet, so that a repeated call can replay it (call_plans.py)."""
    res = _resolution(op, pinned, args, kwargs)
    late: list[Rejection] = []
    chosen = None
    for impl in res.chain:  # usually the first serves; a plain loop, no generator, on the per-call path
        predicate = impl.capability.predicate
        reason = None if predicate is None else predicate(*args, **kwargs)
        if reason is None:
            chosen = impl
            break
        late.append(Rejection(impl.backend, impl.variant, reason))
    if chosen is None:
        raise LigerDispatchError(f"{op}: no backend can serve this call: " + _describe([*res.rejected, *late]))
    if _is_fallback(res, chosen, late):
        return chosen, functools.partial(_fallback, res, chosen, [*res.rejected, *late])
    return chosen, None


def _judged(chain: Sequence[Impl], args, kwargs):
    """(impl, the reason its shape predicate turns this call down, or None), in the order of the chain."""
    for impl in chain:
        predicate = impl.capability.predicate
        yield impl, (predicate(*args, **kwargs) if predicate is not None else None)


def _is_fallback(res: Resolution, chosen: Impl, late: Sequence[Rejection]) -> bool:
    """A requested backend did not serve, or (auto) the reference serves although another backend accepts
    this device type."""
    if res.requested:
        return chosen.backend != res.requested[0]
    return chosen.backend == REFERENCE and any(_better(r) for r in (*res.rejected, *late))


def _better(rejection: Rejection) -> bool:
    """A backend other than the reference that could have served calls on this device type."""
    return rejection.backend != REFERENCE and not rejection.wrong_device


def _describe(rejected: Sequence[Rejection]) -> str:
    return "; ".join(f"{r.backend}: {r.reason}" for r in rejected)


def _fallback(res: Resolution, chosen: Impl, rejected: Sequence[Rejection]) -> None:
    wanted = res.requested[: res.requested.index(chosen.backend)] if chosen.backend in res.requested else res.requested
    relevant = [r for r in rejected if (r.backend in wanted if res.requested else _better(r))]
    why = _describe(relevant) or "no reason recorded"
    if res.requested:
        message = f"requested {', '.join(wanted)} (from {res.source}) cannot serve this call"
    else:
        message = "no backend other than the reference can serve this call"
    message = f"liger_dispatch: {res.op}: {message} [{why}]; falling back to '{chosen.backend}'"
    if strict():
        raise BackendUnavailableError(message + f" ({settings.STRICT.name} is set: a fallback is an error)")
    key = (res.op, ",".join(r.backend for r in relevant), why)
    if key not in _warned:
        _warned.add(key)
        warn_at_caller(message, FallbackWarning)


def reset() -> None:
    """Forget memoized resolutions and emitted warnings (tests, or after changing the environment)."""
    global generation
    _memo.clear()
    _warned.clear()
    tuned.reset()
    generation += 1


def explain_lines(op: str, pinned: tuple[str, ...], args, kwargs) -> tuple[Optional[Impl], list[str]]:
    """Which implementation would serve this call and why each other one would not; no side effects."""
    device, dtypes = call_signature(args, kwargs)
    dtypes = _floating(dtypes)
    tuned_key = tuned.lookup_key(op, device, args, kwargs)
    res = resolve_static(op, pinned, device, dtypes, tuned_key)
    lines = [f"op {op} on {device} ({', '.join(dtype_name(d) for d in dtypes) or 'no float tensors'}); "
             f"preference: {res.source}" + (f" = {', '.join(res.requested)}" if res.requested else "")]
    chosen = None
    late: list[Rejection] = []
    for impl, reason in _judged(res.chain, args, kwargs):
        label = f"{impl.backend} [{impl.variant}]"
        if reason is not None:
            late.append(Rejection(impl.backend, impl.variant, reason))
            lines.append(f"  {label}: cannot serve: {reason}")
        elif chosen is None:
            chosen = impl
            measured = dict(res.tuned.ms) if res.tuned is not None else {}
            why = (f"tuned: {measured[impl.backend]:.3g} ms measured" if impl.backend in measured
                   else f"priority {impl.priority}")
            lines.append(f"  {label}: SELECTED ({why})")
        else:
            lines.append(f"  {label}: capable, not chosen (after {chosen.backend}, priority {impl.priority})")
    for r in res.rejected:
        lines.append(f"  {r.backend}" + (f" [{r.variant}]" if r.variant else "") + f": cannot serve: {r.reason}")
    if not res.requested:
        lines += tuned.explain(op, device, dtypes, tuned_key, res.tuned)
    if chosen is not None and _is_fallback(res, chosen, late):
        lines.append(f"  -> a fallback to {chosen.backend}: warns once per reason, raises under LIGER_STRICT=1")
    return chosen, lines
