"""python -m benchmarks.host_cost: what a call costs the CPU next to what it costs the GPU.

    python -m benchmarks.host_cost                                         # the GPU host: losses and mHC, every backend
    python -m benchmarks.host_cost --out benchmarks/results/h200_host_cost.md
    python -m benchmarks.host_cost --device cpu --quick --backends reference   # the CPU smoke test
    python -m benchmarks.host_cost --device cpu --quick --backends noop --calls 5000   # the noop rows alone, on the CPU

Loss ops (one dispatch handle call, inputs and weight requiring gradients as in training, bf16):
  provider   "noop": a backend returning a preallocated loss, so the row is dispatch alone (binding, the memoized
             checks, the label check's launches, selection, autograd); then every backend that serves the op here;
             "noop, again": the noop rows once more at the end, in the reverse op order (the first rows of a
             process have read higher than the same code measured later)
  handle us  host time of one handle call, the stream idle when it starts (median)
  step us    the same call and its backward (loss.backward(), the inputs' gradients reset outside the timed window)
  impl us    the same call on the implementation the handle selects, directly (no dispatch, no label check)
  extra us   handle - impl: what dispatch adds to the kernels' own launch cost (target: <= 10)
  wall us    --calls handle calls back to back, one synchronization at the end, per call
  graph us   the call captured in one CUDA graph, replayed back to back, per replay: the GPU's time with no host
  gpu us     the kernels' summed duration per handle call (torch.profiler); launches: their count, handle / impl
mhc_coeffs (B=4, HC=4, T x C = 512 x 1024 and 2048 x 4096), forward and torch.autograd.backward of the three outputs:
  eager us   --calls steps back to back, per step (gradients set to None in each, as zero_grad does)
  graph us   the step captured in one CUDA graph, replayed back to back, per replay
  gpu us     the kernels' summed duration per step; host us: host time of one step; launches: kernels per step
  target     eager <= gpu + 100 us
  provider "torch floor": a bare torch.autograd.Function that allocates the op's outputs, saved tensors and
  gradients, no dispatch: what PyTorch alone costs; "floor" stands the kernels in by ops that only allocate their
  outputs: dispatch, autograd and allocations alone; then every backend that serves mhc_coeffs here.
flce at N=8, H=64, V=256 (evaluation and RL scoring loops call the op at such sizes), auto ("ours") and every
backend against torch.nn.functional.cross_entropy(x @ w.T, y): --calls calls back to back, per call (best of
three), fwd+bwd (gradients set to None in each) and a no_grad forward; target: both <= 2x torch's.
--profile K: also each loss op's noop handle call and the tiny flce auto call (no_grad; forward + backward) under
cProfile (--calls calls), their K functions of most own time.
A backend registered here ("noop", "floor") lasts for the process: run this script on its own.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import pstats
import shlex
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

import liger_dispatch as ld
from benchmarks import env as environment
from benchmarks import clocks, mhc_kernels, workloads
from benchmarks.shapes import LM_OPS, Case
from liger_dispatch import dispatch
from liger_dispatch.compose.fused_linear import grad_dtype, wanted_grads
from liger_dispatch.core.table import TABLE

LOSS_DIMS = (("N", 1024), ("H", 1024), ("V", 32000))  # small: the host cost shows, the GPU time does not hide it
MHC_POINTS = ((512, 1024), (2048, 4096))
QUICK_LOSS_DIMS = (("N", 16), ("H", 32), ("V", 100))
QUICK_MHC_POINTS = ((8, 16),)
GPU_BACKENDS = ("triton", "cutedsl", "helion")
TINY_DIMS = (("N", 8), ("H", 64), ("V", 256))
TARGET_TINY_RATIO = 2.0
TARGET_EXTRA_US = 10.0
TARGET_MHC_US = 100.0


def gpu_us(fn: Callable, device: torch.device, calls: int = 5) -> tuple[Optional[float], Optional[float]]:
    """(kernels per call, their summed duration per call in us), from torch.profiler; (None, None) on the CPU."""
    events = clocks.kernels(fn, device, calls)
    if events is None:
        return None, None
    return len(events) / calls, sum(us for _, us in events) / calls


def _like(spec) -> inspect.Signature:
    """The signature an implementation of `spec` must have: its schema, then the implementations' extras."""
    return inspect.Signature([*spec.schema.signature.parameters.values(), *spec.extra.signature.parameters.values()])


def register_noop(op: str, device: torch.device) -> str:
    """A backend of `op` that computes nothing: a preallocated loss, the op's other outputs (statistics) and for each
    gradient asked for a preallocated tensor of its shape (the op's contract, checked on a signature's first call),
    made on the first call of each signature and returned again after it, so the row is dispatch alone; last in
    priority, but auto tries the reference after every other backend: where only the reference serves (the CPU)
    auto picks it, so the auto rows run before it is registered."""
    spec = TABLE.spec(op)
    loss = torch.zeros((), device=device)
    made: dict = {}  # the call's signature -> what it returns

    def returned(args, need_grads, kwargs):
        a = spec.schema.bind(args, {k: v for k, v in kwargs.items() if k not in spec.extra.names})
        need = wanted_grads(need_grads, len(spec.differentiable))
        tensors = [getattr(a, n) for n in spec.differentiable]
        statistics = spec.fake(a)[1:] if spec.schema.returns > 1 else ()
        return (loss, *(torch.empty_like(t, device=device) for t in statistics),
                *(torch.empty(t.shape, dtype=grad_dtype(t), device=device) if w and t is not None else None
                  for w, t in zip(need, tensors)))

    def noop(*args, need_grads=(), **kwargs):
        key = (tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args), tuple(need_grads),
               tuple(kwargs.items()))
        if key not in made:
            made[key] = returned(args, need_grads, kwargs)
        return made[key]

    noop.__signature__ = _like(spec)
    ld.register_backend(op, backend="noop", priority=1 << 20, capability=ld.Capability(devices=(device.type,)),
                        replace=True)(noop)
    return "noop"


def _needs_grads(op: str, inputs: workloads.Inputs) -> list[bool]:
    """need_grads of the call: which of the op's differentiable tensors require gradients."""
    spec = TABLE.spec(op)
    bound = spec.schema.bind(inputs.args, inputs.kwargs)
    return [isinstance(v, torch.Tensor) and v.requires_grad for v in (getattr(bound, n) for n in spec.differentiable)]


def _serving(op: str, device: torch.device, dtype: torch.dtype, asked: Optional[list[str]]) -> list[str]:
    """The asked backends, or every GPU backend that serves op here (the reference where none does)."""
    if asked:
        return asked
    here = ld.available_backends(op, device=device, dtype=dtype)
    return [b for b in GPU_BACKENDS if b in here] or [b for b in here if b == "reference"]


def _fmt(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _dtype(device: torch.device) -> torch.dtype:
    """What every row runs in: bf16 on a GPU, fp32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _loss_call(op: str, device: torch.device, dims: tuple) -> tuple[Case, workloads.Inputs]:
    """The case a loss op's host cost is measured at, and its inputs."""
    case = Case(op, "host", dims[0][1], dims, _dtype(device), "fwd")
    return case, workloads.make_inputs(case, device, seed=0)


def loss_rows(device: torch.device, dims: tuple, calls: int, asked: Optional[list[str]]) -> list[dict]:
    """A row per op and provider, then the noop rows once more in the reverse op order: the first rows of a process
    (right after its first torch.profiler session) have read higher than the same code later."""
    rows, cases = [], {}
    for op in LM_OPS:
        cases[op] = _loss_call(op, device, dims)
        for backend in dict.fromkeys((register_noop(op, device), *_serving(op, device, cases[op][0].dtype, asked))):
            rows.append(_loss_row(op, backend, *cases[op], device, calls))
    for op in reversed(LM_OPS):
        rows.append({**_loss_row(op, "noop", *cases[op], device, calls), "provider": "noop, again"})
    return rows


def _loss_row(op: str, backend: str, case: Case, inputs: workloads.Inputs, device: torch.device, calls: int) -> dict:
    handle = dispatch.op(op, backend=backend)
    impl = handle.select(*inputs.args, **inputs.kwargs)
    need = _needs_grads(op, inputs)

    def through_handle():
        handle(*inputs.args, **inputs.kwargs)

    def step():
        handle(*inputs.args, **inputs.kwargs).backward()

    def direct():
        with torch.no_grad():  # as inside the handle's autograd.Function
            impl.fn(*inputs.args, **inputs.kwargs, need_grads=need)

    through_handle()
    step()
    direct()
    n_handle, gpu = gpu_us(through_handle, device)
    n_impl, _ = gpu_us(direct, device)
    handle_us = clocks.host_us(through_handle, device, calls)
    step_us = clocks.host_us(step, device, calls, inputs.leaves)
    impl_us = clocks.host_us(direct, device, calls)
    extra = handle_us - impl_us
    return {"op": op, "provider": backend, "handle us": _fmt(handle_us), "step us": _fmt(step_us),
            "impl us": _fmt(impl_us), "extra us": _fmt(extra),
            "wall us": _fmt(clocks.wall_us(through_handle, device, calls)),
            "graph us": _fmt(clocks.graph_us(through_handle, device, calls)), "gpu us": _fmt(gpu),
            "launches": f"{_fmt(n_handle, 0)} / {_fmt(n_impl, 0)}",
            "target": "meets" if extra <= TARGET_EXTRA_US else "misses"}


def mhc_rows(device: torch.device, points: tuple, calls: int, asked: Optional[list[str]]) -> list[dict]:
    rows = []
    dtype = _dtype(device)
    mhc_kernels.register_floor_backend(devices=(device.type,))
    backends = ["floor", *(b for b in _serving("mhc_coeffs", device, dtype, asked) if b != "noop")]
    for t, c in points:
        dims = (("B", 4), ("T", t), ("HC", 4), ("C", c))
        case = Case("mhc_coeffs", "host", t * c, dims, dtype, "fwd+bwd")
        inputs = workloads.make_inputs(case, device, seed=0)
        for backend in ("torch floor", *backends):
            floor = backend in ("torch floor", "floor")
            handle = (lambda *args, tmax: mhc_kernels.TorchFloor.apply(*args)) if backend == "torch floor" else \
                dispatch.op("mhc_coeffs", backend=backend)

            def step():
                for leaf in inputs.leaves:  # as zero_grad(set_to_none=True): no accumulation kernels
                    leaf.grad = None
                torch.autograd.backward(handle(*inputs.args, tmax=20), inputs.upstream)

            step()
            launches, gpu = gpu_us(step, device)
            eager = clocks.wall_us(step, device, calls)
            graph = None if floor else clocks.graph_us(step, device, calls)
            verdict = "" if floor or gpu is None else "meets" if eager <= gpu + TARGET_MHC_US else "misses"
            host = clocks.host_us(step, device, calls)
            rows.append({"T x C": f"{t} x {c}", "provider": backend, "eager us": _fmt(eager),
                             "graph us": _fmt(graph), "gpu us": _fmt(gpu), "host us": _fmt(host),
                             "launches": _fmt(launches, 0), "target": verdict})
    return rows


def _tiny_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, hidden, vocab = (v for _, v in TINY_DIMS)
    x = torch.randn(n, hidden, device=device, dtype=_dtype(device), requires_grad=True)
    w = torch.randn(vocab, hidden, device=device, dtype=_dtype(device), requires_grad=True)
    return x, w, torch.randint(0, vocab, (n,), device=device)


def tiny_rows(device: torch.device, calls: int, asked: Optional[list[str]]) -> list[dict]:
    """flce at a tiny shape (small-batch evaluation, RL scoring loops) against torch's own cross-entropy on the
    logits: fwd+bwd and a no_grad forward, back to back."""
    x, w, y = _tiny_inputs(device)
    providers = {"torch": lambda: torch.nn.functional.cross_entropy((x @ w.T).float(), y),
                 "ours": dispatch.op("flce")}
    providers.update((b, dispatch.op("flce", backend=b)) for b in _serving("flce", device, x.dtype, asked)
                     if b != "noop")
    rows, base = [], {}
    for name, fn in providers.items():
        call = fn if name == "torch" else (lambda fn=fn: fn(x, w, y))

        def step():
            x.grad = w.grad = None  # as zero_grad(set_to_none=True)
            call().backward()

        def no_grad():
            with torch.no_grad():
                call()

        step()
        no_grad()
        times = {"fwd+bwd us": clocks.wall_us(step, device, calls), "no_grad us": clocks.wall_us(no_grad, device, calls)}
        base = base or times
        ratios = {k: v / base[k] for k, v in times.items()}
        rows.append({"provider": name, **{k: _fmt(v) for k, v in times.items()},
                     **{f"{k[:-3]} x torch": f"{r:.2f}x" for k, r in ratios.items()},
                     "target": "" if name == "torch" else
                     "meets" if max(ratios.values()) <= TARGET_TINY_RATIO else "misses"})
    return rows


def _profiled(title: str, fn: Callable, calls: int, top: int) -> list[str]:
    """fn called `calls` times under cProfile: the `top` functions of most own time, as a markdown section."""
    fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
    listing = out.getvalue().strip().splitlines()
    start = next(i for i, line in enumerate(listing) if "ncalls" in line)
    return [f"### {title}", "", "```text", *listing[start:], "```", ""]


def noop_profile_lines(device: torch.device, dims: tuple, calls: int, top: int) -> list[str]:
    """Each loss op's noop handle call under cProfile, `calls` of them: the `top` functions of most own time."""
    lines = []
    for op in LM_OPS:
        _, inputs = _loss_call(op, device, dims)
        handle = dispatch.op(op, backend=register_noop(op, device))
        lines += _profiled(f"{op}, {calls} noop handle calls", lambda: handle(*inputs.args, **inputs.kwargs),
                           calls, top)
    return lines


def tiny_profile_lines(device: torch.device, calls: int, top: int) -> list[str]:
    """The tiny-shape flce auto call under cProfile, a no_grad forward and a forward + backward step, `calls` of
    each: the `top` functions of most own time."""
    x, w, y = _tiny_inputs(device)
    flce = dispatch.op("flce")

    def no_grad():
        with torch.no_grad():
            flce(x, w, y)

    def step():
        x.grad = w.grad = None
        flce(x, w, y).backward()

    return [*_profiled(f"flce auto at {TINY_DIMS}, {calls} no_grad calls", no_grad, calls, top),
            *_profiled(f"flce auto at {TINY_DIMS}, {calls} forward + backward steps", step, calls, top)]


TINY_COLUMNS = ("provider", "fwd+bwd us", "no_grad us", "fwd+bwd x torch", "no_grad x torch", "target")
LOSS_COLUMNS = ("op", "provider", "handle us", "step us", "impl us", "extra us", "wall us", "graph us", "gpu us", "launches",
                "target")
MHC_COLUMNS = ("T x C", "provider", "eager us", "graph us", "gpu us", "host us", "launches", "target")


def table(columns, rows: list[dict]) -> list[str]:
    """Markdown lines: the header, then one line per row."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(row[c] for c in columns) + " |" for row in rows)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run host-cost", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, help="calls a measurement takes (host, back to back; default 200, "
                        "3 with --quick)")
    parser.add_argument("--backends", nargs="+", help="backends to measure (default: every GPU backend serving here)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few calls (the CPU smoke test)")
    parser.add_argument("--out", type=Path, help="also write the tables (markdown) there")
    parser.add_argument("--profile", type=int, metavar="K", help="also each loss op's noop handle call and the "
                        "tiny flce auto call under cProfile: their K functions of most own time")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    calls = args.calls or (3 if args.quick else 200)
    loss_dims, points = (QUICK_LOSS_DIMS, QUICK_MHC_POINTS) if args.quick else (LOSS_DIMS, MHC_POINTS)
    run = environment.collect(device, argv)
    command = " ".join(["python -m benchmarks.host_cost", *map(shlex.quote, argv)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks are reported by the provider column, not as warnings here
        # the auto calls first: auto puts the reference last, so on the CPU it would pick the noop and floor
        # backends that the rows after these register
        tiny = tiny_rows(device, calls, args.backends)
        tiny_profile = tiny_profile_lines(device, calls, args.profile) if args.profile else []
        lines = [f"# Host cost per call on {run.gpu} ({run.date}; driver {run.driver}; "
                 + ", ".join(f"{k} {v}" for k, v in run.versions.items()) + ")", "", f"`{command}`", "",
                 f"## Loss ops ({', '.join(f'{k}={v}' for k, v in loss_dims)})", "",
                 *table(LOSS_COLUMNS, loss_rows(device, loss_dims, calls, args.backends)), "",
                 "## mhc_coeffs forward + backward (B=4, HC=4)", "",
                 *table(MHC_COLUMNS, mhc_rows(device, points, calls, args.backends)), "",
                 f"## flce at a tiny shape ({', '.join(f'{k}={v}' for k, v in TINY_DIMS)}), back to back", "",
                 *table(TINY_COLUMNS, tiny)]
        if args.profile:
            lines += ["", f"## Where a call's host time goes (cProfile, {calls} calls)", "",
                      *noop_profile_lines(device, loss_dims, calls, args.profile), *tiny_profile]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
