"""The conformance suite as a library: what CI runs on the in-tree backends, for a backend author to run on theirs.

    import liger_dispatch.testing as lt
    result = lt.verify("mine")            # every op "mine" registers, and every user-level op it then serves
    result.table(); assert result.passed, result.failures

    python -m liger_dispatch verify --backend mine --import mylib.kernels [--device cuda] [--ops OP ...]

Each op the backend serves gets a row per check, all under LIGER_STRICT=1 (a call it cannot serve fails rather than
falls back): conformance (the op's CASES, declared by its op family module in registry/, against the float64
formulas of backends/reference/formulas.py, as relative Frobenius errors of every output and gradient; a
kernel-level op without cases against the reference kernel on float64 copies of its sample), opcheck
(`torch.library.opcheck`, backend pinned), compile (`torch.compile(fullgraph=True)`, forward and backward, no
graph break, equal to eager) and, on CUDA, cuda graph (a captured call replayed, equal to eager).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import math
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from liger_dispatch import dispatch, registry, settings
from liger_dispatch.backends.reference import formulas
from liger_dispatch.capability import default_device, dtype_name
from liger_dispatch.core.table import TABLE
from liger_dispatch.errors import InputError, LigerDispatchError, RegistrationError, UnknownBackendError
from liger_dispatch.registry.cases import Case, Inputs, leaf
from liger_dispatch.timing import cuda_graph, outputs, rel_err

# relative error against the float64 oracle on the same (already rounded) inputs: tf32 matrix units land near 3e-4;
# in bf16 and fp16 the logits themselves are rounded to the input dtype (as in any torch model), and JSD and KL
# gradients amplify that rounding
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 2e-2}
COMPILED_TOLERANCE = 1e-5  # compiled against eager, the same backend: the same kernels
CHECKS = ("conformance", "opcheck", "compile", "cuda graph")


# ---------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Measurement:
    """One compared tensor: its relative error and the limit it is held to (error None: it could not be compared)."""

    name: str
    error: Optional[float]
    tolerance: float
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and self.error is not None and self.error <= self.tolerance

    def describe(self) -> str:
        return self.problem or f"{self.name}: relative error {self.error:.2e} > {self.tolerance:.1e}"


def measure(name, got, want, tol) -> Measurement:
    """Finite, same shape, and within tol relative error, plus twice the truth's own rounding to got's dtype
    (a value barely representable in it, as a ~1e-9 fp16 gradient, may round to the other neighbour)."""
    if got is None or want is None:
        return Measurement(name, None, tol, f"{name}: missing ({'got' if got is None else 'want'} is None)")
    if got.shape != want.shape:
        return Measurement(name, None, tol, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
    if not torch.isfinite(got.float()).all():
        return Measurement(name, math.inf, tol, f"{name}: non-finite values")
    limit = tol + 2 * rel_err(want.to(got.dtype), want)
    return Measurement(name, rel_err(got, want), limit)


def assert_rel_close(name, got, want, tol):
    m = measure(name, got, want, tol)
    assert m.ok, m.describe()


def worst(measurements: Sequence[Measurement]) -> Measurement:
    """The failing measurement if any (the first), else the one closest to its limit."""
    failing = next((m for m in measurements if not m.ok), None)
    return failing or max(measurements, key=lambda m: m.error / m.tolerance if m.tolerance else m.error)


def _copies(inputs: dict, grad_names, widen=False) -> dict:
    """Fresh leaves of the inputs' tensors, requiring grad where named; widen: floating ones in float64."""
    return {k: leaf(v.double() if widen and v.is_floating_point() else v, k in grad_names)
            if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def compare(op, backend, dtype, inputs, kwargs, grad_names, upstream=0.7, used=None,
            row_upstream=1.0) -> list[Measurement]:
    """The backend against the reference formula on copies of `inputs`: outputs, then the gradients of
    `grad_names` from the same upstream gradient (random times `row_upstream` on a per-row output, `upstream` on
    a scalar) through the outputs in `used` (default all)."""
    tol = TOLERANCE[dtype]
    mine = _copies(inputs, grad_names)
    theirs = _copies(inputs, grad_names, widen=True)
    got = outputs(dispatch.op(op, backend=backend)(*mine.values(), **kwargs))
    want = outputs(getattr(formulas, op)(*theirs.values(), **kwargs))
    results, total_got, total_want = [], 0, 0
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None and w is None:  # an output the call did not ask for (CrossEntropyOutput's None fields)
            continue
        results.append(measure(f"output {i}", g.float(), w.float(), tol))
        if used is None or i in used:
            weights = (torch.randn(w.shape, device=w.device, dtype=torch.float32) * row_upstream if w.dim()
                       else torch.tensor(upstream))
            total_got = total_got + (g.float() * weights.to(g.device)).sum()
            total_want = total_want + (w.float() * weights.to(w.device)).sum()
    if not all(m.ok for m in results):
        return results
    total_got.backward()
    total_want.backward()
    return results + [measure(f"grad of {name}", mine[name].grad, theirs[name].grad, tol) for name in grad_names]


def empty_result(op, backend, inputs, kwargs) -> list[Measurement]:
    """Zero rows: loss 0 (as when every row is ignored), an empty per-row result, zero or empty gradients."""
    outs = outputs(dispatch.op(op, backend=backend)(*inputs.values(), **kwargs))
    results = []
    for i, o in enumerate(outs):
        if kwargs.get("reduction") == "none" or o.dim():
            problem = "" if o.shape[0] == 0 else f"output {i}: shape {tuple(o.shape)}, not empty"
            results.append(Measurement(f"output {i}", 0.0, 0.0, problem))
        else:  # the loss, a scalar
            results.append(Measurement(f"output {i}", float(o.detach().float().abs()), 0.0))
    sum(o.float().sum() for o in outs).backward()
    for name, t in inputs.items():
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            continue
        if t.grad is None or t.grad.shape != t.shape:
            results.append(Measurement(f"grad of {name}", None, 0.0, f"grad of {name}: missing or misshapen"))
        else:
            results.append(Measurement(f"grad of {name}", float(t.grad.abs().max()) if t.grad.numel() else 0.0, 0.0))
    return results


# ---------------------------------------------------------------- inputs and cases


def shapes(device) -> dict:
    """The cases' sizes: tiny on the CPU (Triton and Helion run in the interpreter there), real on a GPU; V is a
    prime, a multiple of no block size."""
    if torch.device(device).type == "cuda":
        return dict(N=512, H=256, V=4099, real=True)
    return dict(N=7, H=16, V=131, real=False)


def inputs_for(device, dtype) -> Inputs:
    return Inputs(torch.device(device), dtype, **shapes(device))


def _by_op(table: str) -> dict:
    """Every op family's `table` (CASES or SAMPLES), by op; an op's entry is its own family's alone."""
    merged = {}
    for family in registry.FAMILIES:
        own = getattr(family, table, {})
        if merged.keys() & own.keys():
            raise RegistrationError(f"{family.__name__}.{table} declares {sorted(merged.keys() & own.keys())} again")
        merged.update(own)
    return merged


CASES: dict[str, list[Case]] = _by_op("CASES")
KERNEL_SAMPLES: dict[str, Callable[[Inputs], tuple[tuple, dict]]] = _by_op("SAMPLES")


def case_id(op, backend, dtype, case: str) -> str:
    """The case's name as tests/test_conformance.py shows it: op-backend-dtype-case."""
    return f"{op}-{backend}-{dtype_name(dtype)}-{case}"


def seed_of(op, dtype, case: str) -> int:
    """Every backend sees the same inputs for a case: the seed depends on the op, dtype and case only."""
    return zlib.crc32(f"{op}-{dtype_name(dtype)}-{case}".encode())


def run_case(op, backend, dtype, case: Case, device) -> list[Measurement]:
    """The case's measurements on `backend` (raises what the call raises)."""
    with torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed_of(op, dtype, case.name))
        inputs, options = case.build(inputs_for(device, dtype))
        if case.kind == "empty":
            return empty_result(op, backend, inputs, options)
        return compare(op, backend, dtype, inputs, options, case.grads, case.upstream, case.used, case.row_upstream)


def check_case(op, backend, dtype, case: str, device) -> None:
    """run_case as a test: an AssertionError naming the case and the tensor that failed."""
    found = {c.name: c for c in CASES[op]}[case]
    for m in run_case(op, backend, dtype, found, device):
        assert m.ok, f"{case_id(op, backend, dtype, case)}: {m.describe()}"


def unavailable(op, backend, device, dtype) -> Optional[str]:
    """None when `backend` can serve `op` on device and dtype here, else why not (from explain where it says)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if backend in dispatch.available_backends(op, device=device, dtype=dtype):
        return None
    reason = f"{backend} cannot serve {op} on {device.type} in {dtype_name(dtype)}"
    with contextlib.suppress(Exception):  # the reason is a courtesy; the answer is available_backends'
        args, kwargs = sample_call(op, device, dtype)
        lines = [line.split("cannot serve: ", 1)[1] for line in dispatch.op(op).explain(*args, **kwargs).lines
                 if line.lstrip().startswith((f"{backend} ", f"{backend}:")) and "cannot serve: " in line]
        if lines:
            reason += f": {lines[0]}"
    return reason


# ---------------------------------------------------------------- samples (opcheck, compile, CUDA graphs)


def sample_call(op, device, dtype=torch.float32) -> tuple[tuple, dict]:
    """The op's smallest call as (args, kwargs), tiny on any device: a user-level op's sample case (its
    differentiable arguments requiring grad), or its kernel-level sample."""
    spec = TABLE.spec(op)
    small = Inputs(torch.device(device), dtype, **shapes("cpu"))
    with torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed_of(spec.name, dtype, "sample"))
        if spec.name in KERNEL_SAMPLES:
            return KERNEL_SAMPLES[spec.name](small)
        case = next(c for c in CASES[spec.name] if c.sample)
        inputs, options = case.build(small)
    return tuple(_copies(inputs, case.grads).values()), options


def _written(op) -> list:
    """The parameters an op writes in place (`Tensor(a!)`)."""
    parsed = torch._C.parse_schema(TABLE.spec(op).schema_text)
    return [a for a in parsed.arguments if a.alias_info is not None and a.alias_info.is_write]


def _mutated(op) -> list[int]:
    """Positions of the positional parameters an op writes in place."""
    names = TABLE.spec(op).schema.names
    return [names.index(a.name) for a in _written(op) if not a.kwarg_only]


def _fresh(args: tuple, grad: bool = True) -> tuple:
    """Copies of the call's tensors (requires_grad kept where grad), so every run starts from the same values."""
    return tuple(leaf(a, grad and a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)


def _tensors(out) -> tuple:
    return tuple(o for o in outputs(out) if isinstance(o, torch.Tensor))


def _outputs_and_grads(fn, args):
    """fn(*args)'s tensor outputs and the gradients of its inputs that require grad (outputs weighted by position)."""
    outs = _tensors(fn(*args))
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not leaves:
        return outs, ()
    total = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs) if o.requires_grad)
    return outs, torch.autograd.grad(total, leaves)


def _against_eager(what: str, got, want) -> list[Measurement]:
    """Outputs and gradients, each an _outputs_and_grads, of a compiled or replayed call against eager's."""
    return [measure(f"{what} {kind} {i}", g, w, COMPILED_TOLERANCE)
            for kind, gs, ws in zip(("output", "grad"), got, want) for i, (g, w) in enumerate(zip(gs, ws))]


def check_kernel_against_reference(op, backend, device) -> list[Measurement]:
    """A kernel-level op's sample against the reference kernel on float64 copies: outputs and what it writes."""
    args, kwargs = sample_call(op, device)
    mine = _fresh(args, grad=False)
    mine_kwargs, theirs_kwargs = _copies(kwargs, ()), _copies(kwargs, ())
    theirs = tuple(leaf(a.double() if a.is_floating_point() and a.dim() else a, False)  # 0-dim ones keep their dtype
                   if isinstance(a, torch.Tensor) else a for a in args)
    got = dispatch.op(op, backend=backend)(*mine, **mine_kwargs)
    try:
        want = dispatch.op(op, backend="reference")(*theirs, **theirs_kwargs)
    except InputError:  # an op that takes some tensors in fp32 only: the reference on the same dtypes
        theirs = _fresh(args, grad=False)
        want = dispatch.op(op, backend="reference")(*theirs, **theirs_kwargs)
    pairs = [(f"output {i}", g, w) for i, (g, w) in enumerate(zip(_tensors(got), _tensors(want)))]
    pairs += [(f"{TABLE.spec(op).schema.names[i]} (written in place)", mine[i], theirs[i]) for i in _mutated(op)]
    pairs += [(f"{a.name} (written in place)", mine_kwargs[a.name], theirs_kwargs[a.name])
              for a in _written(op) if a.kwarg_only and kwargs.get(a.name) is not None]
    return [measure(name, g.float(), w, TOLERANCE[torch.float32]) for name, g, w in pairs]


def check_opcheck(op, backend, device) -> list[Measurement]:
    """torch.library.opcheck of torch.ops.liger_dispatch.<op>, the backend pinned, on the op's sample."""
    spec = TABLE.spec(op)
    args, kwargs = sample_call(op, device)
    a = spec.schema.bind(args, kwargs)
    positional, options = spec.schema.call_args(a)
    options = {k: v for k, v in options.items() if v is not None or k in kwargs}
    if "need_grads" in spec.extra.names:  # a loss that computes its gradients in the forward pass
        options["need_grads"] = [getattr(a, n) is not None and getattr(a, n).requires_grad
                                 for n in spec.differentiable]
    result = torch.library.opcheck(getattr(torch.ops.liger_dispatch, spec.name).default, positional,
                                   dict(options, backend=backend))
    failed = {k: v for k, v in result.items() if v != "SUCCESS"}
    return [Measurement("opcheck", None if failed else 0.0, 0.0, f"opcheck: {failed}" if failed else "")]


def check_compile(op, backend, device) -> list[Measurement]:
    """torch.compile(fullgraph=True) of the sample call (and its backward), no graph break, equal to eager."""
    from torch._dynamo.utils import counters

    args, kwargs = sample_call(op, device)
    call = functools.partial(dispatch.op(op, backend=backend), **kwargs)
    eager_args, compiled_args = _fresh(args), _fresh(args)
    want = _outputs_and_grads(call, eager_args)
    counters.clear()
    torch._dynamo.reset()
    got = _outputs_and_grads(torch.compile(call, fullgraph=True), compiled_args)
    breaks = dict(counters["graph_break"])
    if breaks:
        return [Measurement("graph breaks", None, 0.0, f"graph breaks: {breaks}")]
    return _against_eager("compiled", got, want) + [
        measure(f"compiled {TABLE.spec(op).schema.names[i]} (written in place)", compiled_args[i], eager_args[i],
                COMPILED_TOLERANCE) for i in _mutated(op)]


def check_cuda_graph(op, backend, device) -> list[Measurement]:
    """The sample call (forward and backward) captured in a CUDA graph and replayed equals eager."""
    args, kwargs = sample_call(op, device)
    call = functools.partial(dispatch.op(op, backend=backend), **kwargs)
    mutated = _mutated(op)
    static = _fresh(args)

    def step():
        for i in mutated:  # an in-place kernel starts from the same values every replay (args stay unwritten)
            static[i].copy_(args[i])
        return _outputs_and_grads(call, static)

    want = _outputs_and_grads(call, _fresh(args))
    graph, got = cuda_graph(step, warmups=2)
    graph.replay()
    torch.cuda.synchronize()
    return _against_eager("replayed", got, want)


SAMPLE_CHECKS = {"kernel": check_kernel_against_reference, "opcheck": check_opcheck, "compile": check_compile,
                 "cuda graph": check_cuda_graph}


# ---------------------------------------------------------------- verify


@dataclass(frozen=True)
class CaseResult:
    """One row of a verification: a case (or check) of an op on the backend, and what it measured."""

    op: str
    backend: str
    check: str  # conformance, kernel, opcheck, compile, cuda graph
    case: str
    dtype: Optional[torch.dtype]
    status: str  # passed, failed, skipped
    error: Optional[float] = None
    tolerance: Optional[float] = None
    detail: str = ""

    @property
    def id(self) -> str:
        if self.check in ("conformance", "kernel"):
            return case_id(self.op, self.backend, self.dtype, self.case)
        return f"{self.op}-{self.backend}-{self.check.replace(' ', '_')}"


@dataclass
class VerifyResult:
    """What `verify` found: one CaseResult per case and check. `passed`: no failure, and something ran."""

    backend: str
    device: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if c.status == "failed"]

    @property
    def passed(self) -> bool:
        return not self.failures and any(c.status == "passed" for c in self.cases)

    def summary(self) -> str:
        counts = {s: sum(c.status == s for c in self.cases) for s in ("passed", "failed", "skipped")}
        text = f"{self.backend} on {self.device}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
        if self.failures:
            text += "; failing: " + ", ".join(c.id for c in self.failures)
        elif not counts["passed"]:
            text += "; nothing could run here, so nothing is verified"
        return text

    __str__ = summary

    def table(self, console=None) -> None:
        """Prints the rows (rich) and the summary."""
        from rich import box
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=f"liger_dispatch verify: {self.backend} on {self.device}", box=box.SIMPLE_HEAD,
                      padding=(0, 1, 0, 0))
        for column in ("op", "check", "case", "dtype", "result", "error", "tolerance"):
            table.add_column(column, overflow="fold", no_wrap=column != "case")
        style = {"passed": "green", "failed": "bold red", "skipped": "yellow"}
        for c in self.cases:
            table.add_row(c.op, c.check, c.case, dtype_name(c.dtype) if c.dtype else "",
                          f"[{style[c.status]}]{c.status}[/]", "" if c.error is None else f"{c.error:.2e}",
                          "" if c.tolerance is None else f"{c.tolerance:.1e}")
        console.print(table)
        for c in self.cases:  # the reasons in full, below the table: they do not fit a cell
            if c.status != "passed":
                console.print(f"{c.status.upper()} {c.id}: {c.detail}", style=style[c.status], highlight=False,
                              markup=False)
        console.print(self.summary(), style="green" if self.passed else "bold red", highlight=False)


def served_ops(backend: str) -> list[str]:
    """The ops `backend` registers or declares, and the user-level ops it serves through their compositions."""
    return [op for op in TABLE.op_names() if backend in dispatch.registered_backends(op)]


def verify(backend: str, *, device=None, ops: Optional[Sequence[str]] = None, dtypes: Optional[Sequence] = None,
           checks: Sequence[str] = CHECKS, progress: Optional[Callable[[CaseResult], None]] = None) -> VerifyResult:
    """Runs the conformance suite on `backend` (registered already, e.g. by importing its module).

    device: default CUDA when there is one. ops, dtypes, checks: subsets (default all). progress(row): called as
    each row is done. Raises UnknownBackendError for a backend nobody registered, ValueError for an op it does not
    serve or an unknown check."""
    device = torch.device(default_device() if device is None else device)
    mine = served_ops(backend)
    if not mine:
        known = [b for b in TABLE.backend_names() if served_ops(b)]
        raise UnknownBackendError(f"no op has a backend named {backend!r} (import its module first: "
                                  f"--import MODULE); registered backends: {', '.join(known)}")
    if ops:
        names = [TABLE.canonical(o) for o in ops]
        for name in names:
            if name not in mine:
                raise ValueError(f"{backend} serves no {name}; it serves {', '.join(mine)}")
        mine = [o for o in mine if o in names]
    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    result = VerifyResult(backend, str(device))

    def add(row: CaseResult):
        result.cases.append(row)
        if progress is not None:
            progress(row)

    with settings.STRICT.set_to("1"):  # a pinned backend that falls back is an error, not a silent pass
        for op in mine:
            _verify_op(op, backend, device, dtypes, checks, add)
    return result


def _verify_op(op, backend, device, dtypes, checks, add) -> None:
    """Adds the rows of op on backend: its cases' (conformance), then its sample's (the other checks)."""

    def row(check, case, dtype, why: Optional[str], measurements: Callable[[], Sequence[Measurement]]) -> None:
        """Skipped for `why`, else passed or failed by the worst of the measurements, or failed by what they raise."""
        case_result = functools.partial(CaseResult, op, backend, check, case, dtype)
        if why is not None:
            add(case_result("skipped", detail=why))
            return
        try:
            m = worst(measurements())
            add(case_result("passed" if m.ok else "failed", m.error, m.tolerance, m.name if m.ok else m.describe()))
        except Exception as exc:
            add(case_result("failed", detail=f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]))

    cases = CASES.get(op, ())
    if "conformance" in checks:
        for case in cases:
            for dtype in case.dtypes_on(device):
                if dtypes is None or dtype in dtypes:
                    row("conformance", case.name, dtype, unavailable(op, backend, device, dtype),
                        functools.partial(run_case, op, backend, dtype, case, device))
    if not cases and op not in KERNEL_SAMPLES:
        add(CaseResult(op, backend, "conformance", "-", None, "skipped",
                       detail="its op family module in registry/ declares no cases or sample for it"))
        return
    why = unavailable(op, backend, device, torch.float32)
    checks_here = [c for c in checks if c != "conformance" and (c != "cuda graph" or device.type == "cuda")]
    if not cases and "conformance" in checks:
        checks_here.insert(0, "kernel")
    for check in checks_here:
        row(check, "sample", torch.float32, why, functools.partial(SAMPLE_CHECKS[check], op, backend, device))


def load_module(name_or_path: str):
    """Imports a backend's module by dotted name or from a .py file (which registers its implementations)."""
    path = Path(name_or_path)
    if name_or_path.endswith(".py") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"--import {name_or_path}: no such file")
        name = "liger_verify_" + path.stem
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(name_or_path)


def add_arguments(parser) -> None:
    """The `verify` subcommand's arguments (python -m liger_dispatch verify)."""
    parser.add_argument("--backend", required=True, help="the backend to verify (e.g. one your module registers)")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="a module (dotted name or .py file) to import first; it registers the backend")
    parser.add_argument("--ops", nargs="+", metavar="OP", help="only these ops (default: every op it serves)")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, metavar="CHECK", default=list(CHECKS),
                        help=f"only these checks (default: all of {', '.join(CHECKS)})")


def run(args, device: str) -> int:
    """python -m liger_dispatch verify: prints the table; 0 when everything that ran passed, 1 otherwise."""
    from rich.console import Console

    for module in args.imports:
        try:
            load_module(module)
        except Exception as exc:  # the author's module: say which and why, no traceback of ours
            print(f"liger_dispatch verify: error: --import {module} failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 2
    console = Console()
    if not console.is_terminal:  # a log: room for the case names
        console = Console(width=120)
    try:
        result = verify(args.backend, device=device, ops=args.ops, checks=args.checks)
    except (ValueError, LigerDispatchError) as exc:
        print(f"liger_dispatch verify: error: {exc}", file=sys.stderr)
        return 2
    result.table(console)
    return 0 if result.passed else 1
