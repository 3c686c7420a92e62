"""python -m benchmarks.fused_flce_bound: the floor of a fused GEMM+loss flce against the chunked composition.

A fused design that never writes the [N, V] logits keeps only the log-sum-exp from its forward GEMM, so
its backward recomputes the logits tile by tile (a fourth GEMM) before dX and dW. With a loss kernel that
costs nothing, its floor is 2 t(logits GEMM) + t(dX GEMM) + t(dW GEMM), each GEMM timed alone by cuBLAS
at full N. The composition (dispatch.op("flce"), auto-selected backend, fwd+bwd) is measured by the harness.

    python -m benchmarks.fused_flce_bound --out benchmarks/results                  # llama3, N 1024 .. 16384
    python -m benchmarks.fused_flce_bound --shapes tiny --n 64 128 --out /tmp/ffb  # the CPU, in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import env as environment
from benchmarks import clocks, measure, shapes, workloads
from benchmarks.providers import Provider
from liger_dispatch import timing

PROG = "python -m benchmarks.fused_flce_bound"
NS = (1024, 4096, 8192, 16384)
DTYPE = torch.bfloat16
COLUMNS = ("N", "logits GEMM ms", "dX GEMM ms", "dW GEMM ms", "4-GEMM floor ms", "composition ms", "served by",
           "peak MB", "roofline ms", "floor x roofline", "composition x roofline", "floor / composition")
METHOD = """\
GEMMs: cuBLAS alone at full N, bf16 out (logits = X @ W^T into [N, V], dX = G @ W, dW = G^T @ X, G random
[N, V]); in parentheses each one's time over 2NHV FLOPs at the bf16 matmul rate measured in this run.
4-GEMM floor: 2 x logits + dX + dW, the recompute design with a free loss kernel. Composition: dispatch.op("flce")
fwd+bwd through the harness (checked against torch first; median of CUDA-event timings; peak MB above the inputs).
Roofline: 6NHV FLOPs at the measured matmul rate."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="llama3", choices=shapes.LM_PRESETS, help="the LM-head preset")
    p.add_argument("--n", nargs="+", type=int, default=list(NS), help="rows N")
    p.add_argument("--out", type=Path, required=True, help="folder for fused_flce_bound.md")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=150.0, help="timed repetitions' total time per measurement")
    return p.parse_args(argv)


def gemm_ms(case: shapes.Case, device: torch.device, warmup_ms: float, rep_ms: float) -> tuple[float, ...]:
    """Median ms of the logits, dX and dW GEMMs, each alone at the case's full N."""
    n, h, v = (case.dim(k) for k in "NHV")
    gen = torch.Generator(device=device).manual_seed(0)
    x, w, g = (torch.randn(shape, dtype=DTYPE, device=device, generator=gen) for shape in ((n, h), (v, h), (n, v)))
    logits, dx, dw = torch.empty_like(g), torch.empty_like(x), torch.empty_like(w)
    gemms = (lambda: torch.mm(x, w.t(), out=logits), lambda: torch.mm(g, w, out=dx),
             lambda: torch.mm(g.t(), x, out=dw))
    return tuple(timing.bench(fn, [], device, warmup_ms=warmup_ms, rep_ms=rep_ms).ms for fn in gemms)


def composition(case: shapes.Case, settings: measure.Settings) -> tuple[measure.Outcome, str]:
    """The harness's outcome for dispatch.op("flce") on `case`, and the backend the selection picked."""
    from liger_dispatch import dispatch

    handle = dispatch.op(case.op)
    served = "-"

    def flce(*args, **kwargs):  # handle(*args, **kwargs), remembering the backend that served it
        nonlocal served
        served = handle.select(*args, **kwargs).backend
        return handle(*args, **kwargs)

    outcomes = []
    measure.measure_case(case, [Provider("auto", lambda _: flce)], settings, measure.History(),
                         lambda _, outcome: outcomes.append(outcome))
    return outcomes[0], served


def row(case: shapes.Case, gemms: tuple[float, ...], outcome: measure.Outcome, served: str,
        tflops: float) -> list[str]:
    """The cells of one N, in COLUMNS order."""
    def roofline_ms(mode: str) -> float:
        return workloads.work(case, mode)[0] / (tflops * 1e12) * 1e3

    gemm_roofline, roofline = roofline_ms("fwd"), roofline_ms("fwd+bwd")
    logits, dx, dw = gemms
    floor = 2 * logits + dx + dw
    ok = outcome.status == measure.OK
    comp = outcome.timing.ms if ok else math.nan
    peak = f"{outcome.peak_mb:.0f}" if outcome.peak_mb is not None else "-"
    return [str(case.n), *(f"{t:.4g} ({t / gemm_roofline:.3g}x)" for t in gemms), f"{floor:.4g}",
            f"{comp:.4g}" if ok else outcome.status, served, peak, f"{roofline:.4g}", f"{floor / roofline:.3g}",
            f"{comp / roofline:.3g}" if ok else "-", f"{floor / comp:.3g}" if ok else "-"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment.collect(device, argv)
    env = dataclasses.replace(env, command=" ".join([PROG, *map(shlex.quote, argv)]))
    console = Console(soft_wrap=True)
    if not console.is_terminal:  # logs of a device run: no wrapping at 80 columns
        console.width = 200
    tflops = clocks.matmul_tflops(device, args.rep_ms)
    columns = env.columns()
    header = " | ".join([columns.pop("date"), columns.pop("gpu"), f"`{columns.pop('command')}`",
                         *(f"{k} {v}" for k, v in columns.items()), f"matmul {tflops:.3g} TFLOP/s (measured now)"])
    console.print(header)
    # nothing is skipped (max_row_s, deadline)
    settings = measure.Settings(device, args.warmup_ms, args.rep_ms, math.inf, math.inf, timing.l2_bytes(device))
    rows = []
    for case in shapes.cases("flce", [args.shapes], args.n, None, [DTYPE], ["fwd+bwd"]):
        console.print(f"N={case.n} {case.describe()}: GEMMs, then the composition")
        gemms = gemm_ms(case, device, args.warmup_ms, args.rep_ms)
        rows.append(row(case, gemms, *composition(case, settings), tflops))
    head = shapes.LM_PRESETS[args.shapes]
    title = f"flce {head.name} (H={head.hidden}, V={head.vocab}) bf16 fwd+bwd: fused recompute floor vs composition"
    table = Table(*COLUMNS, title=title, title_justify="left")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fused_flce_bound.md"
    lines = [f"# {title}", "", header, "", METHOD, "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "---:|" * len(COLUMNS), *("| " + " | ".join(r) + " |" for r in rows)]
    path.write_text("\n".join(lines) + "\n")
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
