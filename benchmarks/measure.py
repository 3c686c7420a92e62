"""One case for every provider: a correctness check against a reference (the op's eager formula) on fresh inputs,
then time and peak memory of the providers that pass, on other inputs.

A provider that fails the check is reported FAIL and not timed; running out of memory is OOM; a
size a provider cannot fit or finish (predicted from the smaller sizes of this run) is skipped, saying why.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from benchmarks import clocks, shapes, workloads
from benchmarks.peers import Unsupported
from benchmarks.providers import EAGER, Provider, formula
from benchmarks.shapes import Case
from liger_dispatch import timing

OK, FAIL, OOM, SKIPPED, NOT_APPLICABLE = "ok", "FAIL", "OOM", "skipped", "n/a"
NOT_REACHED = "not reached"  # the run's time budget was spent first: reported, never recorded
# Calls one timed row makes: check, first call, timing.bench's estimate and warm-up, min_reps, memory.
CALLS_PER_ROW = 14


@dataclass
class Settings:
    device: torch.device
    warmup_ms: float
    rep_ms: float
    max_row_s: float  # skip a size predicted to keep one row busy longer than this
    deadline: float  # time.monotonic() after which the remaining rows are skipped
    l2_bytes: int
    seed: int = 0
    warm: bool = False  # L2 not flushed between repetitions, one input set (what a repeated training step sees)
    truth: Optional[torch.dtype] = None  # check against the formula in this dtype (float64), not in the input dtype
    rounds: int = 1  # the providers of a case timed in turn, this many times over (fwd and fwd+bwd)


@dataclass(frozen=True)
class Workload:
    """What a run's cases compute: each case's inputs, and the function every provider is checked against."""

    make_inputs: Callable[[Case, torch.device, int], timing.Inputs]  # (case, device, seed)
    reference: Callable[[Case], Callable]
    reference_provider: Optional[str]  # the provider that computes the reference itself: not checked against it


OP_WORKLOAD = Workload(workloads.make_inputs, lambda case: formula(case.op), EAGER)  # each op against its formula


@dataclass
class Outcome:
    status: str
    timing: Optional[timing.Timing] = None
    peak_mb: Optional[float] = None
    errors: tuple[float, float] = (math.nan, math.nan)
    notes: list[str] = field(default_factory=list)


class ContextLost(RuntimeError):
    """The device is unusable after a provider's error (an illegal address, say): nothing after it can run."""


class History:
    """What each provider did at the smaller sizes of this run."""

    def __init__(self) -> None:
        self._last: dict[tuple, tuple[int, Outcome]] = {}

    @staticmethod
    def _key(case: Case, provider: str) -> tuple:
        return case.op, case.shape, case.dtype, case.mode, provider

    def record(self, case: Case, provider: str, outcome: Outcome) -> None:
        if outcome.status in (OK, OOM):
            self._last[self._key(case, provider)] = (case.n, outcome)

    def skip_reason(self, case: Case, provider: str, s: Settings) -> Optional[str]:
        """Why this size is out of the provider's reach, judged from its last smaller size."""
        last = self._last.get(self._key(case, provider))
        if last is None or last[0] >= case.n:
            return None
        n, outcome = last
        if outcome.status == OOM:
            return f"OOM at {n}"
        scale = case.n / n
        row_s = outcome.timing.ms * scale * CALLS_PER_ROW / 1e3
        if row_s > s.max_row_s:
            return f"predicted {row_s:.0f} s for this row from {outcome.timing.ms:.0f} ms at {n} (--max-row-s)"
        free = timing.free_bytes(s.device)
        if outcome.peak_mb is not None and free is not None and outcome.peak_mb * 2**20 * scale > 0.9 * free:
            need = outcome.peak_mb * scale / 1024
            return f"predicted {need:.0f} GB above its inputs from {outcome.peak_mb / 1024:.1f} GB at {n}; {free / 2**30:.0f} GB free"
        return None


def measure_case(case: Case, providers: list[Provider], s: Settings, history: History,
                 done: Callable[[Provider, Outcome], None], workload: Workload = OP_WORKLOAD) -> None:
    """Measure `case` for every provider, calling done(provider, outcome) as each row is settled."""

    def finish(p: Provider, outcome: Outcome) -> None:
        if p.note:
            outcome.notes.insert(0, p.note)
        history.record(case, p.name, outcome)
        done(p, outcome)

    if time.monotonic() > s.deadline:  # not even the reference is worth computing
        for p in providers:
            finish(p, _skip(case, p, s, history))
        return
    passed: list[tuple[Provider, Callable, tuple[float, float]]] = []
    checked_at = case.n
    try:
        check_inputs, want, checked_at = _reference(case, s, workload)
    except Exception as exc:  # no reference at any size: every provider of this case fails
        _ensure_device(s.device, "the reference")
        for p in providers:
            finish(p, Outcome(FAIL, notes=[f"no reference: {_describe(exc)}"]))
        return
    for p in providers:
        skip = _skip(case, p, s, history)
        if skip:
            finish(p, skip)
            continue
        outcome, fn, errors = _check(p, case, check_inputs, want, checked_at, s, workload.reference_provider)
        if outcome is None:
            passed.append((p, fn, errors))
        else:
            finish(p, outcome)
    del check_inputs, want
    _cleanup(s.device)

    note = [] if checked_at == case.n else [f"checked at {checked_at}"]
    if s.truth is not None:
        note.insert(0, f"errors against {str(s.truth).removeprefix('torch.')}")
    sets = _input_sets(case, s, workload) if passed else []
    if len(sets) > 1:
        note.append(f"inputs rotated over {len(sets)} sets")
    leaves = [leaf for inputs in sets for leaf in inputs.leaves]
    rounds = 1 if case.mode == "bwd" else max(1, s.rounds)
    if rounds > 1 and len(passed) > 1:
        note.append(f"providers interleaved over {rounds} rounds")
    live, steps, times = [], {}, {}
    for p, fn, errors in passed:
        skip = _skip(case, p, s, history)
        if skip:
            skip.errors = errors
            finish(p, skip)
        else:
            live.append((p, fn, errors))
    for r, (p, fn, errors) in timing.turns(live, rounds):
        last = r == rounds - 1
        outcome = None
        try:
            step = steps.pop(p.name, None) or timing.step(fn, sets, case.mode)
            times.setdefault(p.name, []).extend(timing.round_samples(
                step, leaves, s.device, r, rounds, warmup_ms=s.warmup_ms, rep_ms=s.rep_ms, flush=not s.warm))
            if last:
                peak = clocks.peak_mb(step, leaves, s.device)
                outcome = Outcome(OK, timing.summarize(times[p.name]), peak, errors, list(note))
            else:
                steps[p.name] = step
        except Exception as exc:
            outcome = Outcome(OOM if _is_oom(exc) else FAIL, errors=errors, notes=[f"while timing: {_describe(exc)}"])
            live.remove((p, fn, errors))
        step = None
        for leaf in leaves:
            leaf.grad = None
        _cleanup(s.device)
        _ensure_device(s.device, p.name)
        if outcome is not None:
            finish(p, outcome)


def _skip(case: Case, p: Provider, s: Settings, history: History) -> Optional[Outcome]:
    if time.monotonic() > s.deadline:
        return Outcome(NOT_REACHED, notes=["the run's time budget was spent (--time-budget-s)"])
    reason = history.skip_reason(case, p.name, s)
    return Outcome(SKIPPED, notes=[reason]) if reason else None


def _reference(case: Case, s: Settings, workload: Workload):
    """(check inputs, the reference's result on them, N they are at): halves N while it runs out of memory."""
    at = case
    while True:
        inputs = workload.make_inputs(at, s.device, s.seed + 1)
        try:
            truth_inputs = inputs if s.truth is None else _converted(inputs, s.truth)
            return inputs, timing.run(workload.reference(case), truth_inputs, case.mode), at.n
        except Exception as exc:
            if not _is_oom(exc) or shapes.halved(at) is None:
                raise
        inputs = None
        _cleanup(s.device)
        at = shapes.halved(at)


def _converted(inputs: timing.Inputs, dtype: torch.dtype) -> timing.Inputs:
    """The same call with its floating-point tensors in `dtype` (leaves stay leaves, upstream gradients follow)."""
    def convert(t):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            return t
        return t.detach().to(dtype).requires_grad_(t.requires_grad)

    converted = {id(t): convert(t) for t in (*inputs.args, *inputs.kwargs.values())}
    return timing.Inputs(tuple(converted[id(t)] for t in inputs.args),
                         {k: converted[id(t)] for k, t in inputs.kwargs.items()},
                         [converted[id(t)] for t in inputs.leaves],
                         None if inputs.upstream is None else tuple(map(convert, inputs.upstream)))


def _check(p: Provider, case: Case, inputs, want, checked_at: int, s: Settings, reference_provider: Optional[str]):
    """(failing outcome or None, the provider's callable, (output error, gradient error))."""
    if p.name == reference_provider and checked_at == case.n and s.truth is None:
        return None, p.build(case), (math.nan, math.nan)  # it is the reference
    failed = None
    try:
        fn = p.build(case)
        errors = timing.compare(timing.run(fn, inputs, case.mode), want)
    except Unsupported as exc:
        return Outcome(NOT_APPLICABLE, notes=[str(exc)]), None, None
    except Exception as exc:
        failed = Outcome(OOM if _is_oom(exc) else FAIL, notes=[f"while checking: {_describe(exc)}"])
    if failed is not None:  # outside the except block, so the traceback's tensors can be freed
        _cleanup(s.device)
        _ensure_device(s.device, p.name)
        return failed, None, None
    if not timing.passes(errors, case.dtype):
        tol = timing.TOLERANCE[case.dtype]
        return Outcome(FAIL, errors=errors, notes=[f"error above {tol:g} (output {errors[0]:.2e}, "
                                                   f"gradients {errors[1]:.2e})"]), None, None
    return None, fn, errors


def _input_sets(case: Case, s: Settings, workload: Workload) -> list[timing.Inputs]:
    """Inputs for timing, several sets when one would fit in L2 and make it look faster (one set when warm)."""
    first = workload.make_inputs(case, s.device, s.seed + 2)
    if s.warm:
        return [first]
    copies = timing.input_copies(first.nbytes(), s.l2_bytes)
    return [first] + [workload.make_inputs(case, s.device, s.seed + 2 + i) for i in range(1, copies)]


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _ensure_device(device: torch.device, after: str) -> None:
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except Exception as exc:
        raise ContextLost(f"the CUDA context is unusable after {after}: {_describe(exc)}") from exc
