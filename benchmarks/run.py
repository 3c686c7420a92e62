"""python -m benchmarks.run: time every provider of the requested ops, write <gpu>.csv, <gpu>.md and plots.

    python -m benchmarks.run --ops flce --shapes llama3 --n 1024 4096
    python -m benchmarks.run --ops all --shapes tiny          # the CPU, in seconds
    python -m benchmarks.run host-cost --out host_cost.md     # one of the measurements in TOOLS, its own --help

Every measurement times through liger_dispatch.timing (the one timing path, shared with `python -m
liger_dispatch tune`); host-cost and the dispatch_overhead rows use its host clocks.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks import env as environment
from benchmarks import clocks, measure, overhead, providers, report, shapes, workloads
from liger_dispatch import timing

RESULTS = Path(__file__).resolve().parent / "results"
TOOLS = {  # `python -m benchmarks.run <name> ...`: the harness's other measurements, one module each
    "host-cost": ("benchmarks.host_cost", "host time per call next to GPU time, eager and CUDA-graph wall"),
    "hf-step": ("benchmarks.hf_step", "one training step of a Hugging Face model, unpatched vs patched"),
    "vocab-parallel": ("benchmarks.vocab_parallel", "the vocab-parallel losses against the single-process op"),
    "flce-bound": ("benchmarks.fused_flce_bound", "the floor of a fused GEMM + CE flce against the composition"),
    "loss-kernels": ("benchmarks.loss_kernels", "one backend's loss kernels alone against the bandwidth"),
    "mhc-kernels": ("benchmarks.mhc_kernels", "each backend's mHC kernels against the byte floor"),
    "helion-configs": ("benchmarks.helion_tune", "regenerate the Helion backend's config tables"),
    "rl-losses": ("benchmarks.rl_losses", "whole GRPO and DPO losses at an LM head, ours against liger-kernel's"),
    "chunk-budgets": ("benchmarks.chunk_budgets", "an LM-head loss's time and peak memory at several chunk budgets"),
    "kernel-times": ("benchmarks.kernel_times", "each kernel's GPU time in one provider's step, summed by name"),
}


def _listed(values: list[str] | None) -> list[str] | None:
    """Space- or comma-separated lists: `--ops flce,fused_linear_jsd` == `--ops flce fused_linear_jsd`."""
    if values is None:
        return None
    return [v for value in values for v in value.split(",") if v]


def _check_choices(parser: argparse.ArgumentParser, flag: str, values: list[str], choices) -> None:
    bad = [v for v in values if v not in choices]
    if bad:
        parser.error(f"{flag}: unknown {', '.join(bad)} (choose from {', '.join(sorted(choices))})")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown; the list of other measurements kept one a line."""


def add_timing_options(p: argparse.ArgumentParser) -> None:
    """How rows are timed: the options of every measurement that times through benchmarks.measure."""
    p.add_argument("--warmup-ms", type=float, default=timing.WARMUP_MS)
    p.add_argument("--rep-ms", type=float, default=timing.REP_MS, help="timed repetitions' total time per row")
    p.add_argument("--max-row-s", type=float, default=60.0,
                   help="skip a size predicted (from the smaller ones) to keep one row busy longer")
    p.add_argument("--time-budget-s", type=float, default=math.inf,
                   help="after this, the remaining rows are skipped (results are written as they come)")
    p.add_argument("--rounds", type=int, default=timing.ROUNDS,
                   help="time a case's providers in turn this many times over, each for a share of --rep-ms "
                        "(fwd and fwd+bwd), so that a drift of the GPU's clocks reaches all of them alike")
    p.add_argument("--seed", type=int, default=0)


def timing_settings(args: argparse.Namespace, device: torch.device, started: float, warm: bool = False,
                    truth: Optional[torch.dtype] = None) -> measure.Settings:
    """The measure.Settings of add_timing_options' options, for a run that started at time.monotonic() `started`."""
    return measure.Settings(device, args.warmup_ms, args.rep_ms, args.max_row_s, started + args.time_budget_s,
                            timing.l2_bytes(device), args.seed, warm, truth, args.rounds)


def parse_args(argv: list[str]) -> argparse.Namespace:
    tools = "\n".join(f"  {name:15} {about}" for name, (_, about) in TOOLS.items())
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=_Help,
                                epilog=f"other measurements (python -m benchmarks.run NAME --help):\n{tools}")
    p.add_argument("--ops", nargs="+", default=["all"], help=f"any of {', '.join(shapes.OPS)}, or all")
    p.add_argument("--shapes", nargs="+", help=f"presets: {', '.join(shapes.LM_PRESETS)} "
                   "(default: llama3 on a GPU, tiny on the CPU)")
    p.add_argument("--n", nargs="+", type=int, help="N sweep of the LM-head ops (default: the preset's)")
    p.add_argument("--tc", nargs="+", type=shapes.parse_tc, help="TxC points of mhc_coeffs, e.g. 512x1024")
    p.add_argument("--dtypes", nargs="+", default=["bf16"], help=f"any of {', '.join(shapes.DTYPES)}")
    p.add_argument("--providers", nargs="+", help="our backends by name (reference too), ours (auto selection), "
                   "ours:compile, ours:cudagraphs, torch, torch.compile, liger-kernel, cut-cross-entropy, quack, verl "
                   "(default: all that can run, but the reference and ours)")
    p.add_argument("--mode", nargs="+", default=["fwd+bwd"], help=f"any of {', '.join(shapes.MODES)}")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    p.add_argument("--warm", action="store_true", help="time without flushing L2 between repetitions, on one "
                   "input set (rows get the mode fwd+bwd-warm etc., beside the flushed ones)")
    p.add_argument("--truth", choices=("formula", "float64"), default="formula",
                   help="what every provider is checked against: the op's eager formula in the input dtype, or that "
                   "formula on the same inputs in float64 (the error columns are then the distance to float64, and "
                   "the torch provider is checked too)")
    add_timing_options(p)
    args = p.parse_args(argv)
    args.ops = _listed(args.ops)
    if args.ops == ["all"]:
        args.ops = list(shapes.OPS)
    _check_choices(p, "--ops", args.ops, shapes.OPS)
    args.ops.sort(key=shapes.OPS.index)  # dispatch_overhead registers a backend: it runs last
    args.shapes = _listed(args.shapes)
    if args.shapes:
        _check_choices(p, "--shapes", args.shapes, shapes.LM_PRESETS)
    args.dtypes = _listed(args.dtypes)
    _check_choices(p, "--dtypes", args.dtypes, shapes.DTYPES)
    args.mode = _listed(args.mode)
    _check_choices(p, "--mode", args.mode, shapes.MODES)
    args.providers = _listed(args.providers)
    if args.providers and providers.unknown_names(args.providers):
        p.error(f"--providers: unknown {', '.join(providers.unknown_names(args.providers))}")
    return args


def _plan(args, device: torch.device, console: Console):
    """[(case, providers to measure, (name, reason) of those that cannot run)] in run order."""
    plan = []
    for op in args.ops:
        if op == report.OVERHEAD:
            continue
        for dtype_name in args.dtypes:
            dtype = shapes.DTYPES[dtype_name]
            chosen, skipped = providers.resolve(op, device, dtype, args.providers)
            console.print(f"[bold]{op}[/] {dtype_name}: " + (", ".join(p.name for p in chosen) or "no provider"))
            for name, reason in skipped:
                console.print(f"  {name}: {reason}")
            for case in shapes.cases(op, args.shapes, args.n, args.tc, [dtype], args.mode):
                plan.append((case, chosen, skipped))
    return plan


def row_line(r: dict[str, str]) -> str:
    """One settled row, as the log prints it."""
    parts = [f"{r['op']} {r['shape']} {r['n']} {r['dtype']} {r['mode']} {r['provider']}: {r['status']}"]
    if r["ms"]:
        parts.append(f"{float(r['ms']):.4g} ms")
    if r["x_roofline"]:
        parts.append(f"{float(r['x_roofline']):.2f}x roofline")
    if r["peak_mb"]:
        parts.append(f"{float(r['peak_mb']):.0f} MB")
    if r["note"]:
        parts.append(f"({r['note']})")
    return " ".join(parts)


def _summaries(rows: list[dict[str, str]]) -> list[Table]:
    """Per op, shape, dtype and mode: ms and x roofline by size (rows) and provider (columns)."""
    groups: dict[tuple, list[dict[str, str]]] = {}
    for r in rows:
        if r["status"] != report.UNAVAILABLE:
            groups.setdefault((r["op"], r["shape"], r["dtype"], r["mode"]), []).append(r)
    tables = []
    for (op, shape, dtype, mode), group in groups.items():
        names = list(dict.fromkeys(r["provider"] for r in group))
        table = Table("n", *names, title=f"{op} {shape} {dtype} {mode}: ms (x roofline)", title_justify="left")
        for n in dict.fromkeys(r["n"] for r in group):
            cells = {r["provider"]: _cell(r) for r in group if r["n"] == n}
            table.add_row(n, *(cells.get(name, "") for name in names))
        tables.append(table)
    return tables


def _cell(r: dict[str, str]) -> str:
    if r["status"] != measure.OK:
        return r["status"]
    if r["op"] == report.OVERHEAD:
        return f"{float(r['ms']) * 1e6:.0f} ns"
    roof = f" ({float(r['x_roofline']):.2f}x)" if r["x_roofline"] else ""
    return f"{float(r['ms']):.4g}{roof}"


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU, set to one thread."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        # CPU runs exercise the harness on tiny shapes: one thread, or OpenMP's spinning on a busy
        # machine makes each tiny op take milliseconds.
        torch.set_num_threads(1)
    return device


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:
        return importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:]) or 0
    # A pinned backend that cannot serve a call must fail, not be timed under its name as the reference.
    os.environ["LIGER_STRICT"] = "1"
    args = parse_args(argv)
    started = time.monotonic()
    device = default_device()
    args.shapes = args.shapes or (["llama3"] if device.type == "cuda" else ["tiny"])
    env = environment.collect(device, argv)
    console = Console(soft_wrap=True)
    if not console.is_terminal:  # logs of a device run: no wrapping at 80 columns
        console.width = 160
    console.print(f"{env.gpu} | driver {env.driver} | " + " | ".join(f"{k} {v}" for k, v in env.versions.items()))
    tflops, gbps = clocks.matmul_tflops(device, args.rep_ms), clocks.copy_gbps(device, args.rep_ms)
    console.print(f"matmul {tflops:.0f} TFLOP/s, copy {gbps:.0f} GB/s (measured now)")
    settings = timing_settings(args, device, started, args.warm, torch.float64 if args.truth == "float64" else None)
    plan = _plan(args, device, console)
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / f"{env.gpu_short}.csv"
    history = measure.History()
    this_run: list[dict[str, str]] = []  # what goes into the CSV
    total = sum(len(chosen) + len(skipped) for _, chosen, skipped in plan) + 2 * (report.OVERHEAD in args.ops)
    status = 0
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("benchmarks", total=total)

        def settle(case, name, outcome, roofline_ms=None):
            r = report.row(case, name, outcome, env, tflops, gbps, roofline_ms, args.warm and case.op != report.OVERHEAD)
            if outcome.status != measure.NOT_REACHED:  # keep what an earlier run measured
                this_run.append(r)
            if outcome.status != report.UNAVAILABLE:  # said once per op, when planning
                progress.console.print(row_line(r))
            progress.advance(task)

        try:
            for case, chosen, skipped in plan:
                progress.update(task, description=f"{case.op} {case.shape} {case.n} {case.dtype_name} {case.mode}")
                flops, nbytes = workloads.work(case)
                roofline_ms = max(flops / (tflops * 1e12), nbytes / (gbps * 1e9)) * 1e3
                first = len(this_run)
                for name, reason in skipped:
                    settle(case, name, measure.Outcome(report.UNAVAILABLE, notes=[reason]))
                measure.measure_case(case, chosen, settings, history,
                                     lambda p, outcome: settle(case, p.name, outcome, roofline_ms))
                report.merge_csv(csv_path, this_run[first:])
            if report.OVERHEAD in args.ops:
                progress.update(task, description=report.OVERHEAD)
                case = shapes.Case(report.OVERHEAD, "-", 0, (), torch.bfloat16, "call")
                first = len(this_run)
                for name, outcome in overhead.measure(device):
                    settle(case, name, outcome)
                report.merge_csv(csv_path, this_run[first:])
        except measure.ContextLost as exc:
            console.print(f"[red]stopped: {exc}[/]; rerun without that provider (--providers)")
            status = 1
    all_rows = report.read_csv(csv_path)
    report.write_markdown(args.out / f"{env.gpu_short}.md", all_rows)
    plots = report.write_plots(args.out, env.gpu_short, all_rows)
    for table in _summaries(this_run):
        console.print(table)
    console.print(f"wrote {csv_path}, {args.out / (env.gpu_short + '.md')} and {len(plots)} plots "
                  f"in {time.monotonic() - started:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
