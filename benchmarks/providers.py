"""The providers a benchmark compares: our backends through dispatch, torch eager, torch.compile, the peers.

A provider turns a Case into a callable with the project's signature for that op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from benchmarks import peers
from benchmarks.env import version
from benchmarks.shapes import MODEL_OPS, Case

EAGER = "torch"
COMPILED = "torch.compile"
REFERENCE = "reference"
# Our auto selection in eager code, as a user calls it (the tuned table, then static priority, picks per call).
OURS_AUTO = "ours"
# Our auto selection called from code that torch.compile compiles (fullgraph), and the same under
# mode="reduce-overhead" (CUDA graphs): the ops inside a compiled training step.
OURS_COMPILED = "ours:compile"
OURS_GRAPHED = "ours:cudagraphs"
_OURS_TRACED = {OURS_COMPILED: "default", OURS_GRAPHED: "reduce-overhead"}
_NOT_OURS = {EAGER, COMPILED, OURS_AUTO, *_OURS_TRACED, *peers.PEERS}
# Arguments whose first dimension is N: kept dynamic so one compilation serves the whole N sweep.
_ROW_ARGS = {"flce": (0, 2), "fused_linear_jsd": (0, 2, 4), "fused_linear_kl_div": (0, 2, 3),
             "fused_linear_logprobs": (0, 2)}


@dataclass(frozen=True)
class Provider:
    name: str
    build: Callable[[Case], Callable]
    note: str = ""


def formula(op: str) -> Callable:
    """The eager formula of `op`: the torch provider, and the reference every provider is checked against."""
    from liger_dispatch.backends.reference import formulas

    return getattr(formulas, op)


def _eager(case: Case) -> Callable:
    return formula(case.op)


class _Compiled:
    """torch.compile of the eager formula, one per op; dynamo recompiles once per shape preset, dtype and
    grad mode (never per N), and the compilation happens in the check call, before any timing."""

    def __init__(self) -> None:
        self._fns: dict[str, Callable] = {}
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def __call__(self, case: Case) -> Callable:
        fn = self._fns.get(case.op)
        if fn is None:
            fn = self._fns[case.op] = self._compile(case.op)
        return fn

    @staticmethod
    def _compile(op: str) -> Callable:
        return compiled_over_rows(formula(op), _ROW_ARGS.get(op, ()))


def compiled_over_rows(fn: Callable, rows: Sequence[int]) -> Callable:
    """torch.compile(fn) with the first dimension of each positional argument in `rows` dynamic: one compilation
    serves every N."""
    compiled = torch.compile(fn)

    def call(*args, **kwargs):
        for i in rows:
            if isinstance(args[i], torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(args[i], 0)
        return compiled(*args, **kwargs)

    return call


class _OursTraced:
    """dispatch.op(case.op) inside a torch.compile(fullgraph=True) region, one per op (N dynamic)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._fns: dict[str, Callable] = {}

    def __call__(self, case: Case) -> Callable:
        fn = self._fns.get(case.op)
        if fn is None:
            from liger_dispatch import dispatch

            handle = dispatch.op(case.op)
            compiled = torch.compile(lambda *a, **k: handle(*a, **k), fullgraph=True, mode=self.mode)
            rows = _ROW_ARGS.get(case.op, ())

            graphed = self.mode == "reduce-overhead"

            def fn(*args, **kwargs):
                for i, arg in enumerate(args):
                    if not isinstance(arg, torch.Tensor):
                        continue
                    if i in rows:
                        torch._dynamo.maybe_mark_dynamic(arg, 0)
                    elif graphed and rows:
                        # an LM head's weights are a model's parameters, static inputs of its CUDA graphs: unmarked,
                        # each replay would first copy the [V, H] weight into the graph's own buffer (~0.5 ms)
                        torch._dynamo.mark_static_address(arg, guard=False)
                if graphed:  # each call is an iteration: the graph's outputs of the last one may be reused
                    torch.compiler.cudagraph_mark_step_begin()
                return compiled(*args, **kwargs)

            self._fns[case.op] = fn
        return fn


def _dispatched(backend: Optional[str]) -> Callable[[Case], Callable]:
    def build(case: Case) -> Callable:
        from liger_dispatch import dispatch

        return dispatch.op(case.op, backend=backend)

    return build


def _peer(name: str) -> Callable[[Case], Callable]:
    def build(case: Case) -> Callable:
        return peers.PEERS[name].adapter(case.op)

    return build


def _our_backends(op: str, device: torch.device, dtype: torch.dtype) -> tuple[list[str], dict[str, str]]:
    """(backends usable here, best first; {backend: why not} for the registered others)."""
    from liger_dispatch import dispatch

    try:
        usable = dispatch.available_backends(op, device=device.type, dtype=dtype)
    except KeyError as exc:  # the op is not declared (yet): say so, time the others
        return [], {"liger_dispatch": str(exc)}
    reasons = dispatch.backend_status(op, device.type, dtype)
    return usable, {b: reason for b, reason in reasons.items() if b not in usable}


def resolve(op: str, device: torch.device, dtype: torch.dtype,
            requested: Optional[Sequence[str]] = None) -> tuple[list[Provider], list[tuple[str, str]]]:
    """The providers to time for `op`, in table order, and (name, reason) for each one that cannot run.

    Without `requested`: every usable backend but the reference, torch, torch.compile and every
    installed peer that has this op. With it: exactly those names (the reference included, if asked).
    """
    if requested is None or any(name not in _NOT_OURS for name in requested):
        usable, not_usable = _our_backends(op, device, dtype)
    else:  # asking the framework would import every backend module: seconds, for nothing
        usable, not_usable = [], {}
    chosen: list[Provider] = []
    skipped: list[tuple[str, str]] = []
    ours = [b for b in usable if requested is not None or b != REFERENCE]
    for backend in ours:
        chosen.append(Provider(backend, _dispatched(backend)))
    for backend, reason in not_usable.items():
        if requested is None or backend in requested:
            skipped.append((backend, f"not available: {reason}"))
    chosen += [Provider(EAGER, _eager), Provider(COMPILED, _Compiled())]
    if requested is not None and OURS_AUTO in requested:
        chosen.append(Provider(OURS_AUTO, _dispatched(None), "auto selection"))
    if device.type == "cuda":
        chosen += [Provider(name, _OursTraced(mode), f"auto selection, torch.compile mode={mode}")
                   for name, mode in _OURS_TRACED.items()]
    for name, peer in peers.PEERS.items():
        if requested is not None and name not in requested:
            continue
        if op not in peer.ops:
            if requested is not None:
                skipped.append((name, f"has no {op}"))
            continue
        reason = peers.unavailable(name, device)
        if reason is not None:
            skipped.append((name, reason))
        else:
            chosen.append(Provider(name, _peer(name), f"{peer.distribution} {version(peer.distribution)}"))
    if requested is not None:
        order = {name: i for i, name in enumerate(requested)}
        chosen = sorted((p for p in chosen if p.name in order), key=lambda p: order[p.name])
        skipped = [(n, r) for n, r in skipped if n in order]
        seen = {p.name for p in chosen} | {n for n, _ in skipped}
        skipped += [(n, f"has no {op} here") for n in requested if n not in seen]
    return chosen, skipped


def unknown_names(names: Sequence[str]) -> list[str]:
    """The names that are neither a provider of the harness nor a backend registered for any op."""
    names = [n for n in names if n not in _NOT_OURS | {REFERENCE}]
    if not names:
        return []
    from liger_dispatch import dispatch

    ours = set()
    for op in MODEL_OPS:
        try:
            ours.update(dispatch.registered_backends(op))
        except KeyError:  # an op not declared (yet)
            pass
    return [n for n in names if n not in ours]
