"""Results files: `<gpu>.csv` (merged across invocations), `<gpu>.md` (tables by op) and PNG plots.

Each CSV row carries the date, GPU, driver, versions and command of the run that measured it; the
markdown lists every run its rows come from, and each plot's footer names the latest one.
"""

from __future__ import annotations

import csv
import math
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Optional

from benchmarks.env import Environment
from benchmarks.measure import OK, Outcome
from benchmarks.shapes import OPS, Case

KEY = ("op", "shape", "n", "dtype", "provider", "mode")
COLUMNS = (*KEY, "status", "ms", "ms_p20", "ms_p80", "peak_mb", "x_roofline", "roofline_ms", "err_out", "err_grad",
           "dims", "note", "date", "gpu", "driver", "torch", "triton", "helion", "cutlass", "matmul_tflops",
           "copy_gbps", "command")
UNAVAILABLE = "unavailable"
WARM_SUFFIX = "-warm"
OVERHEAD = "dispatch_overhead"
_RUN_COLUMNS = ("date", "gpu", "driver", "torch", "triton", "helion", "cutlass", "matmul_tflops", "copy_gbps",
                "command")

METHOD = """\
Time: median (p20-p80) of CUDA-event timings as `triton.testing.do_bench` takes them (a host clock on the CPU)
after warm-up, L2 flushed and gradients set to None before every call, outside the timed window; inputs rotated over
several sets where one set would fit in L2; the providers of a case timed in turn over several rounds (`--rounds`,
noted on the row). Memory: peak allocated during one call above what was allocated before it
(gradients count, inputs do not). x roofline: time / max(GEMM FLOPs at the bf16 matmul rate, bytes at the
copy bandwidth), both measured in the same run. GEMM FLOPs per pass: flce and kl fwd 2NHV, bwd 4NHV; jsd
fwd 4NHV, bwd 4NHV; fwd+bwd is the sum. mHC is bound by bytes: x and phi read once per pass, their
gradients written once. fwd runs under torch.no_grad; bwd times backward alone. Every provider is first
checked against the torch eager formulas (torch is the reference) on fresh random inputs: relative norm of
the loss or outputs and of every gradient, bf16 and fp16 1e-2, fp32 2e-3; FAIL rows are not timed.
Rows noting "errors against float64" (`--truth float64`) were checked against the same formula on the same
inputs in float64 instead, torch included.
torch.compile is compiled once per shape preset (N dynamic), before timing. Modes ending in "-warm" (`--warm`)
time the same way without the L2 flush, on one input set."""


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def row(case: Case, provider: str, outcome: Outcome, env: Environment, matmul_tflops: float, copy_gbps: float,
        roofline_ms: Optional[float] = None, warm: bool = False) -> dict[str, str]:
    """One CSV row; a warm-L2 measurement's mode reads e.g. "fwd+bwd-warm" (its own rows, tables and plots)."""
    t = outcome.timing
    values = {
        "op": case.op, "shape": case.shape, "n": case.n, "dtype": case.dtype_name, "provider": provider,
        "mode": case.mode + (WARM_SUFFIX if warm else ""), "status": outcome.status,
        "ms": t and t.ms, "ms_p20": t and t.p20, "ms_p80": t and t.p80, "peak_mb": outcome.peak_mb,
        "x_roofline": t.ms / roofline_ms if t and roofline_ms else None, "roofline_ms": roofline_ms,
        "err_out": outcome.errors[0], "err_grad": outcome.errors[1], "dims": case.describe(),
        "note": "; ".join(outcome.notes), **env.columns(), "matmul_tflops": matmul_tflops, "copy_gbps": copy_gbps,
    }
    return {k: _fmt(values[k]) for k in COLUMNS}


def read_csv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [{k: r.get(k) or "" for k in COLUMNS} for r in csv.DictReader(f)]


def merge_csv(path: Path, rows: Iterable[dict[str, str]]) -> None:
    """Add rows to the CSV, replacing any with the same (op, shape, n, dtype, provider, mode)."""
    merged = {tuple(r[k] for k in KEY): r for r in read_csv(path)}
    merged.update({tuple(r[k] for k in KEY): r for r in rows})
    ordered = sorted(merged.values(), key=_sort_key)
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(ordered)
    tmp.replace(path)


def _num(text: str) -> Optional[float]:
    return float(text) if text else None


def _sort_key(r: dict[str, str]):
    op_rank = OPS.index(r["op"]) if r["op"] in OPS else len(OPS)
    ms = _num(r["ms"])
    return (op_rank, r["shape"], r["dtype"], r["mode"], int(r["n"] or 0), r["status"] != OK,
            ms if ms is not None else math.inf, r["provider"])


def _groups(rows: list[dict[str, str]]) -> dict[tuple, list[dict[str, str]]]:
    groups: dict[tuple, list[dict[str, str]]] = defaultdict(list)
    for r in sorted(rows, key=_sort_key):
        groups[(r["op"], r["shape"], r["dtype"], r["mode"])].append(r)
    return groups


def _split_dims(rows: list[dict[str, str]]) -> tuple[str, dict[int, str]]:
    """(dims shared by the group, per row id the dims that vary): 'H=4096 V=128256' and 'N=1024'."""
    tokens = [r["dims"].split() for r in rows]
    common = [t for t in tokens[0] if all(t in other for other in tokens)]
    return " ".join(common), {id(r): " ".join(t for t in toks if t not in common) for r, toks in zip(rows, tokens)}


# ---------------------------------------------------------------- markdown


def _cell(text: str, digits: str = ".3g") -> str:
    return format(float(text), digits) if text else ""


def _error_cell(r: dict[str, str]) -> str:
    errs = [_cell(r[k], ".1e") for k in ("err_out", "err_grad")]
    return " / ".join(e or "-" for e in errs) if any(errs) else ""


def _lm_table(rows: list[dict[str, str]]) -> tuple[list[str], str]:
    """(the table lines, the dims every row shares)."""
    common, varying = _split_dims(rows)
    lines = ["| size | provider | ms | p20-p80 | x roofline | peak MB | error out / grad | note |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    missing: dict[str, str] = {}
    for r in rows:
        if r["status"] == UNAVAILABLE:
            missing[r["provider"]] = r["note"]
            continue
        ms = _cell(r["ms"], ".4g") if r["status"] == OK else f"**{r['status']}**"
        spread = f"{_cell(r['ms_p20'], '.4g')}-{_cell(r['ms_p80'], '.4g')}" if r["status"] == OK else ""
        roof = f"{float(r['x_roofline']):.2f}x" if r["x_roofline"] else ""
        peak = _cell(r["peak_mb"], ".0f")
        lines.append(f"| {varying[id(r)]} | {r['provider']} | {ms} | {spread} | {roof} | {peak} | "
                     f"{_error_cell(r)} | {r['note'].replace('|', '/')} |")
    lines += [""] + [f"- not run: {name}: {why}" for name, why in missing.items()]
    return lines, common


def _overhead_table(rows: list[dict[str, str]]) -> list[str]:
    lines = ["| provider | ns per call | p20-p80 | note |", "|---|---:|---:|---|"]
    for r in rows:
        ns = [float(r[k]) * 1e6 for k in ("ms", "ms_p20", "ms_p80")]
        lines.append(f"| {r['provider']} | {ns[0]:.0f} | {ns[1]:.0f}-{ns[2]:.0f} | {r['note']} |")
    return lines


def _runs_table(rows: list[dict[str, str]]) -> list[str]:
    runs = sorted({tuple(r[k] for k in _RUN_COLUMNS) for r in rows})
    lines = ["| date | GPU | driver | torch | triton | helion | cutlass | bf16 matmul TFLOP/s | copy GB/s | command |",
             "|---|---|---|---|---|---|---|---:|---:|---|"]
    for run in runs:
        cells = list(run)
        cells[7], cells[8] = _cell(cells[7], ".0f"), _cell(cells[8], ".0f")
        cells[9] = f"`{cells[9]}`"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_markdown(path: Path, rows: list[dict[str, str]], title: str = "liger-dispatch benchmarks",
                   method: str = METHOD) -> None:
    """`# title on <gpus>`, how the rows were measured, the runs they come from, then a table per op, shape, dtype
    and mode."""
    gpus = sorted({r["gpu"] for r in rows})
    lines = [f"# {title} on {', '.join(gpus)}", "", method, "", "## Runs", "", *_runs_table(rows)]
    current_op = None
    for (op, shape, dtype, mode), group in _groups(rows).items():
        if op != current_op:
            lines += ["", f"## {op}"]
            current_op = op
        if op == OVERHEAD:
            lines += ["", *_overhead_table(group)]
            continue
        table, common = _lm_table(group)
        lines += ["", f"### {shape} ({common}), {dtype}, {mode}", "", *table]
    path.write_text("\n".join(lines).rstrip() + "\n")


# ---------------------------------------------------------------- plots


def _footer(rows: list[dict[str, str]]) -> str:
    r = max(rows, key=lambda r: r["date"])
    text = (f"{r['date']} | {r['gpu']} | driver {r['driver']} | torch {r['torch']} | triton {r['triton']} | "
            f"helion {r['helion']} | cutlass {r['cutlass']} | {r['command']}")
    return "\n".join(textwrap.wrap(text, 150))


def write_plots(out_dir: Path, stem: str, rows: list[dict[str, str]]) -> list[Path]:
    """One PNG per op, shape, dtype and mode: time and peak memory against N, a line per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {name: f"C{i % 10}" for i, name in enumerate(sorted({r["provider"] for r in rows}))}
    written = []
    for (op, shape, dtype, mode), group in _groups(rows).items():
        ok = [r for r in group if r["status"] == OK]
        if op == OVERHEAD or not ok:
            continue
        common, _ = _split_dims(group)
        fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(13, 5))
        by_provider: dict[str, list[dict[str, str]]] = defaultdict(list)
        for r in ok:
            by_provider[r["provider"]].append(r)
        for provider, pts in sorted(by_provider.items()):
            pts.sort(key=lambda r: int(r["n"]))
            ns = [int(r["n"]) for r in pts]
            style = {"marker": "o", "label": provider, "color": colors[provider]}  # the same in every figure
            ax_time.plot(ns, [float(r["ms"]) for r in pts], **style)
            mem = [(n, float(r["peak_mb"])) for n, r in zip(ns, pts) if r["peak_mb"]]
            if mem:
                ax_mem.plot(*zip(*mem), **style)
        x_label = "T*C" if op == "mhc_coeffs" else "N (rows)"
        for ax, y_label in ((ax_time, "ms (median)"), (ax_mem, "peak MB above the inputs")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.grid(True, which="both", alpha=0.3)
        ax_time.legend(fontsize=8)
        if ax_mem.lines:
            ax_mem.legend(fontsize=8)
        else:
            ax_mem.text(0.5, 0.5, "no memory statistics off CUDA", ha="center", transform=ax_mem.transAxes)
        fig.suptitle(f"{op}  {shape} ({common})  {dtype}  {mode}")
        fig.text(0.01, 0.01, _footer(group), fontsize=7, va="bottom")
        fig.tight_layout(rect=(0, 0.07, 1, 0.95))
        path = out_dir / f"{stem}_{op}_{shape}_{dtype}_{mode.replace('+', '-')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
