"""`python -m liger_dispatch tune`: time every backend that can serve each (op, dtype, shape) on this GPU and write
the table that auto selection reads (tuned.py).

    python -m liger_dispatch tune --out h200.json         # the default set: ~2-3 minutes on an H200
    LIGER_TUNED_TABLE=$PWD/h200.json python train.py       # use it (or copy it to liger_dispatch/tuning/tables/)

A point is one op at one shape, in the bucket tuned.bucket_of gives its call. Each backend is measured through
`dispatch.op(op, backend=b)` with liger_dispatch.timing, as the benchmark harness measures a provider, with the same
defaults: one fwd+bwd call (also the compiling one) checked against the reference where the reference's logits fit
(points.CHECK_LOGITS; a backend that disagrees is left out), then the point's backends in turn over --rounds, L2
flushed, inputs rotated over copies where one set would fit in L2; the median. The reference is not timed: auto
selection uses it only as the fallback. An existing table at --out with the same key keeps its other entries and
lists the runs written into it before ("earlier").

Only on a GPU: on the CPU the interpreters' times say nothing about any kernel. --budget-s: a point, and each
backend's measurement in it, starts only when its predicted time fits in what is left; a point is measured whole
or not at all (an entry that lacks a backend would rank it last). A point whose inputs and gradients (first made
on the meta device) would not fit in 90 % of the free memory is skipped.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from liger_dispatch import dispatch, settings, timing
from liger_dispatch.core import selection
from liger_dispatch.tuning import tuned
from liger_dispatch.capability import dtype_name
from liger_dispatch.errors import FallbackWarning
from liger_dispatch.core.table import REFERENCE, TABLE
from liger_dispatch.tuning.points import Point

PROG = "python -m liger_dispatch tune"
DEFAULT_NS = (1024, 2048, 4096, 8192, 16384)
MEMORY_FRACTION = 0.9  # of the free memory a point's inputs and gradients may take


def too_large(sized: list[Point], device: torch.device) -> Optional[str]:
    """Why points (made on the meta device) do not fit in this device's free memory, or None."""
    need = max((p.inputs.nbytes() + sum(t.numel() * t.element_size() for t in p.inputs.leaves) for p in sized),
               default=0)  # the inputs and the gradients their leaves receive
    free = timing.free_bytes(device) if device.type == "cuda" else timing.host_free_bytes()
    if free is None or need <= MEMORY_FRACTION * free:
        return None
    return (f"{sized[0].op} {sized[0].shape}: skipped: its inputs and gradients take {need / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB free")


def backends_for(op: str, device: torch.device, dtype: torch.dtype, asked: Optional[Sequence[str]] = None
                 ) -> tuple[list[str], dict[str, str]]:
    """(the backends to time for op here, {the others: why not}), the reference left out. A backend that serves
    but is not `asked` is among the others: an entry says nothing about a backend it did not measure."""
    serving = [b for b in dispatch.available_backends(op, device=device, dtype=dtype) if b != REFERENCE]
    usable = [b for b in serving if asked is None or b in asked]
    others = {b: why for b, why in dispatch.backend_status(op, device, dtype).items()
              if why is not None and b != REFERENCE}
    others.update({b: "not measured (--backends)" for b in serving if b not in usable})
    return usable, others


class Budget:
    """The run's deadline, its timing options, and the last per-call time of each (op, backend), to predict its
    next measurement."""

    def __init__(self, seconds: float, reps: int, *, warmup_ms: float = timing.WARMUP_MS,
                 rep_ms: float = timing.REP_MS, rounds: int = timing.ROUNDS):
        self.seconds, self.rounds = seconds, rounds
        self.schedule = {"warmup_ms": warmup_ms, "rep_ms": rep_ms, "min_reps": reps}  # timing.round_share's arguments
        self.deadline = time.monotonic() + seconds
        self._per_call: dict[tuple[str, str], tuple[int, float]] = {}  # (op, backend) -> (bytes, ms)

    def record(self, point: Point, backend: str, ms: float) -> None:
        self._per_call[(point.op, backend)] = (point.inputs.nbytes(), ms)

    def predict_s(self, point: Point, backend: str) -> float:
        """Seconds the measurement of `backend` at `point` will take (0 before its op's first one)."""
        last = self._per_call.get((point.op, backend))
        if last is None:
            return 0.0
        nbytes, ms = last
        ms *= point.inputs.nbytes() / max(nbytes, 1)
        if backend != REFERENCE:  # the checking call, then the rounds (the reference makes only the first)
            ms *= 1 + timing.rounds_calls(ms, self.rounds, **self.schedule)
        return ms / 1e3

    def short(self, points: Sequence[Point], backends: Sequence[str]) -> Optional[str]:
        """Why measuring `backends` at `points` is predicted not to fit in what is left, or None."""
        seconds = sum(self.predict_s(p, b) for p in points for b in backends)
        left = self.deadline - time.monotonic()
        if seconds <= left and left > 0:
            return None
        return f"predicted {seconds:.1f} s, {max(left, 0.0):.1f} s of the {self.seconds:.0f} s budget left"


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def measure(sets: Sequence[Point], backends: list[str], dtype: torch.dtype, device: torch.device, budget: Budget,
            log) -> Optional[dict[str, float]]:
    """{backend: ms} of the backends that serve the point and agree with the reference, timed in turn over the
    rounds on `sets` (the point's copies, rotated); None when the budget does not reach every backend."""
    point, inputs = sets[0], sets[0].inputs
    why = budget.short([point], [REFERENCE, *backends])
    if why:
        log(f"    not reached: {why}")
        return None
    want = None
    if point.check:
        try:
            start = time.perf_counter()
            want = timing.run(dispatch.op(point.op, backend=REFERENCE), inputs)
            budget.record(point, REFERENCE, (time.perf_counter() - start) * 1e3)
        except Exception as exc:  # out of memory, say: nothing to check the backends against
            log(f"    the reference FAILED ({_describe(exc)}); not timed")
            return {}
    steps = {}
    for backend in backends:
        why = budget.short([point], [backend])
        if why:
            log(f"    {backend}: not reached: {why}")
            return None
        handle = dispatch.op(point.op, backend=backend)
        if handle.select(*inputs.args, **inputs.kwargs).backend != backend:
            log(f"    {backend}: does not serve this shape")
            continue
        try:
            got = timing.run(handle, inputs)  # also the first (compiling) call
            errors = timing.compare(got, want) if want is not None else None
            got = None  # free its gradients (the leaves' size) before the timing
        except Exception as exc:  # one backend failing (out of memory, say) must not end the whole run
            log(f"    {backend}: FAILED ({_describe(exc)}); not timed")
            continue
        if errors is not None and not timing.passes(errors, dtype):
            log(f"    {backend}: MISMATCH with the reference (relative error: outputs {errors[0]:.2e}, "
                f"gradients {errors[1]:.2e}); not timed")
            continue
        steps[backend] = timing.step(handle, [p.inputs for p in sets])
    leaves = [leaf for p in sets for leaf in p.inputs.leaves]
    timed, samples = list(steps), {backend: [] for backend in steps}
    for r, backend in timing.turns(timed, budget.rounds):
        try:
            samples[backend] += timing.round_samples(steps[backend], leaves, device, r, budget.rounds,
                                                     **budget.schedule)
        except Exception as exc:
            log(f"    {backend}: FAILED ({_describe(exc)}); not timed")
            timed.remove(backend)
    times = {b: timing.summarize(samples[b]).ms for b in timed}
    for backend, ms in times.items():
        budget.record(point, backend, ms)
        log(f"    {backend}: {ms:.3f} ms" + ("" if want is not None else " (not checked: too large)"))
    return times


def entry(point: Point, dtype: torch.dtype, times: dict[str, float], unavailable: dict[str, str]) -> dict:
    """A table entry; `unavailable` keeps it from ordering calls where one of those backends can serve."""
    n, rest = tuned.bucket_of(point.op, point.inputs.args, point.inputs.kwargs)
    fastest_first = sorted(times.items(), key=lambda item: item[1])
    return {"op": point.op, "dtype": dtype_name(dtype), "n": n, "bucket": tuned.describe_rest(rest),
            "shape": point.shape, "ms": {b: round(t, 4) for b, t in fastest_first}, "unavailable": unavailable}


def merged(path: Path, key: dict, entries: list[dict]) -> tuple[list[dict], list[dict]]:
    """(entries plus those of an existing table at `path` made with the same key (new ones win), the earlier runs
    written into that table, oldest first: its own "earlier", then its "written" and "command")."""
    if not path.exists():
        return entries, []
    try:
        old_key, old_entries = tuned.read_table(path)
        old = json.loads(path.read_text())
    except tuned.TunedTableError as exc:
        print(f"overwriting {path}: {exc}")
        return entries, []
    if not tuned.same_key(old_key, key):
        print(f"overwriting {path}: it was made on {tuned.describe_key(old_key)}")
        return entries, []
    fresh = {(e["op"], e["dtype"], e["n"], e["bucket"]) for e in entries}
    kept = [e for e in old_entries if (e["op"], e["dtype"], e["n"], e["bucket"]) not in fresh]
    runs = [*old.get("earlier", []), {k: old[k] for k in ("written", "command") if k in old}] if kept else []
    return kept + entries, runs


def tune_group(make: Callable[[torch.device], Iterator[Point]], usable: list[str], unavailable: dict[str, str],
               dtype: torch.dtype, device: torch.device, budget: Budget, entries: list[dict]) -> int:
    """Adds the entries of the points make(device) yields (one allocation); how many the budget did not reach."""
    sized = list(make(torch.device("meta")))  # the points' sizes, nothing allocated
    why = too_large(sized, device)
    if why:
        print(f"  {why}")
        return 0
    why = budget.short(sized, [REFERENCE, *usable])
    if why:
        print(f"  {sized[0].op} {sized[0].shape}: not reached: {why}")
        return len(sized)
    copies = timing.input_copies(max(p.inputs.nbytes() for p in sized), timing.l2_bytes(device))
    left = 0
    try:
        for sets in zip(*(make(device) for _ in range(copies))):  # each point `copies` times, made alike
            print(f"  {sets[0].describe()}" + (f" (inputs rotated over {copies} sets)" if copies > 1 else ""))
            for backend, reason in unavailable.items():
                print(f"    {backend}: NOT AVAILABLE here ({reason}); the entry will not order calls where it is")
            times = measure(sets, usable, dtype, device, budget, print)
            left += times is None
            if times:
                entries.append(entry(sets[0], dtype, times, unavailable))
            sets = None
    except Exception as exc:  # making the inputs ran out of memory, say
        print(f"  {sized[0].op}: FAILED ({_describe(exc)})")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return left


def _refuse(why: str) -> int:
    print(f"{PROG}: {why}; no table written", file=sys.stderr)
    return 1


def run(args, device: str, dtype: torch.dtype, *, interpreted: bool = False) -> int:
    """The tune command; 0 when it wrote a table. interpreted=True times the CPU's interpreted backends anyway
    (the project's tests: the path, not the numbers)."""
    device = torch.device(device)
    if device.type != "cuda" and not interpreted:
        return _refuse(f"nothing to tune on the {device.type}: the backends that serve there are the reference and "
                       "the Triton and Helion interpreters, whose times say nothing about a GPU kernel; run it on "
                       "the GPU the table is for")
    plan = {op: backends_for(op, device, dtype, args.backends) for op in args.ops}
    if not any(usable for usable, _ in plan.values()):
        reasons = "; ".join(f"{op}: " + (", ".join(f"{b} ({why})" for b, why in others.items()) or "only the reference")
                            for op, (_, others) in plan.items())
        return _refuse(f"nothing to tune on {device}, {dtype_name(dtype)}: no backend but the reference serves "
                       f"({reasons})")
    key = tuned.device_key(device)
    print(f"tuning on {tuned.describe_key(key)}, {dtype_name(dtype)}")
    for op, (usable, others) in plan.items():
        if not usable:
            print(f"  {op}: not tuned: no backend but the reference serves here "
                  f"({', '.join(f'{b}: {why}' for b, why in others.items())})")
    budget = Budget(args.budget_s, args.reps, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, rounds=args.rounds)
    entries, left = [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)  # a backend that falls back is reported, not timed
        for op in (op for op in args.ops if plan[op][0]):  # the others: said above
            for make in TABLE.spec(op).tuning.groups(args, dtype):  # make(device) yields points sharing inputs
                left += tune_group(make, *plan[op], dtype, device, budget, entries)
    if left:
        print(f"time budget ({args.budget_s:.0f} s) spent: {left} points not reached")
    if not entries:
        return _refuse("no point was measured (the reasons are above)")
    out = Path(args.out)
    all_entries, earlier = merged(out, key, entries)
    written = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    table = {"format": tuned.FORMAT, "key": key, "written": written,
             "command": "python -m liger_dispatch " + " ".join(sys.argv[1:]),
             **({"earlier": earlier} if earlier else {}), "entries": all_entries}
    out.write_text(tuned.dumps(table))
    selection.reset()  # the tables read, and the selections and handles' plans made from them
    print(f"wrote {len(entries)} entries to {out}; use it with {settings.TUNED_TABLE.name}={out.resolve()}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ops = [name for name in TABLE.op_names("user") if TABLE.spec(name).tuning is not None]  # OpSpec.tuning declared
    parser.add_argument("--ops", nargs="+", default=ops, choices=ops)
    parser.add_argument("--n", nargs="+", type=int, default=list(DEFAULT_NS), help="rows of the LM-head ops")
    parser.add_argument("--hidden", type=int, default=4096, help="H of the LM-head ops (default: llama3's)")
    parser.add_argument("--vocab", type=int, default=128256, help="V of the LM-head ops (default: llama3's)")
    for op in ops:  # each family's own options
        for flags, options in TABLE.spec(op).tuning.arguments:
            parser.add_argument(*flags, **options)
    parser.add_argument("--backends", nargs="+", help="time only these (default: every backend that serves here)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions a backend and point, at least (median)")
    parser.add_argument("--rep-ms", type=float, default=timing.REP_MS,
                        help="timed repetitions' total time a backend and point, at least (the harness's default)")
    parser.add_argument("--rounds", type=int, default=timing.ROUNDS,
                        help="time the backends of a point in turn this many times over, the repetitions shared out")
    parser.add_argument("--warmup-ms", type=float, default=timing.WARMUP_MS,
                        help="untimed calls after the checking one and bench's estimate, in ms (at least one call)")
    parser.add_argument("--budget-s", type=float, default=170.0,
                        help="the run's time: no point or backend starts that is predicted to end after it")
    parser.add_argument("--out", default="liger-tuned.json", help="the table to write (merged when its key matches)")
