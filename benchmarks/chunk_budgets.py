"""The chunk budget's trade: an LM-head loss's fwd+bwd time and peak memory at several LIGER_CHUNK_BUDGET_MB values.

    python -m benchmarks.run chunk-budgets                                   # flce, llama3, N 1024 4096 16384
    python -m benchmarks.run chunk-budgets --n 16384 --budgets 512 375 245 --backend triton

A smaller budget cuts the rows into more chunks: a smaller logits buffer (the peak above the inputs is dW, dX and
one chunk), and one more in-place dW accumulation per extra chunk. Whether that accumulation costs its 2 GB of
traffic or hides in the compute-bound dW GEMM decides how low the budget can go at each N. Budgets are timed in
turn over --rounds rounds (the order rotated each round), each call on the same inputs; "vs first" is the median
against the first budget's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks import clocks, env, shapes, workloads
from liger_dispatch import dispatch, settings, timing
from liger_dispatch.compose import fused_linear as fl

PROG = "python -m benchmarks.run chunk-budgets"
OPS = ("flce", "fused_linear_jsd", "fused_linear_kl_div")


def budget_mb(value: float):
    return settings.CHUNK_BUDGET_MB.set_to(f"{value:g}")


def chunking(case: shapes.Case, budget: float) -> tuple[int, int]:
    """(rows a chunk, chunks) of this case at this budget (a teacher's logits count for JSD)."""
    logit_bytes = case.dtype.itemsize * (2 if case.op == "fused_linear_jsd" else 1)
    n = case.dim("N")
    with budget_mb(budget):
        rows = fl.chunk_rows(n, case.dim("V"), logit_bytes)
    return rows, -(-n // rows)


def measure(case: shapes.Case, budgets: list[float], backend: str | None, device: torch.device, rounds: int,
            rep_ms: float) -> list[tuple]:
    """Per budget: (budget, each round's median ms, peak MB above the inputs, (output, gradient) error against the
    first budget's call). A budget whose result is not the first's (timing.passes) fails the run."""
    inputs = workloads.make_inputs(case, device, seed=0)
    fn = dispatch.op(case.op, backend=backend)
    call = timing.step(fn, [inputs])
    times = {b: [] for b in budgets}
    peaks, errors, first = {}, {}, None
    for r in range(rounds):
        for b in budgets[r % len(budgets):] + budgets[:r % len(budgets)]:
            with budget_mb(b):
                if b not in peaks:
                    result = timing.run(fn, inputs)  # also compiles what a new chunking needs, outside the peak
                    first = result if first is None else first
                    errors[b] = timing.compare(result, first)
                    peaks[b] = clocks.peak_mb(call, inputs.leaves, device)
                times[b].append(timing.bench(call, inputs.leaves, device, warmup_ms=rep_ms / 4, rep_ms=rep_ms).ms)
    return [(b, times[b], peaks[b], errors[b]) for b in budgets]


def table(rows: list[tuple]) -> list[str]:
    lines = ["| op | N | budget MB | rows a chunk | chunks | ms (median of rounds) | per round | vs first | peak MB "
             "| error out / grad vs first |", "|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for case, results in rows:
        first = None
        for budget, per_round, peak, (out_err, grad_err) in results:
            ms = timing.summarize(per_round).ms
            first = first or ms
            chunk, chunks = chunking(case, budget)
            lines.append(f"| {case.op} | {case.dim('N')} | {budget:g} | {chunk} | {chunks} | {ms:.3f} | "
                         f"{' '.join(f'{t:.3f}' for t in per_round)} | {100 * (ms / first - 1):+.1f} % | "
                         f"{'-' if peak is None else f'{peak:.0f}'} | {out_err:.1e} / {grad_err:.1e} |")
    return lines


def agree(rows: list[tuple]) -> bool:
    return all(timing.passes(errors, case.dtype) for case, results in rows for *_, errors in results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ops", nargs="+", default=["flce"], choices=OPS)
    parser.add_argument("--shape", default=None, help="a preset of benchmarks/shapes.py (llama3 on a GPU, tiny off)")
    parser.add_argument("--n", nargs="+", type=int, default=None, help="rows (default: the preset's LM-head N)")
    parser.add_argument("--budgets", nargs="+", type=float, default=[512.0, 375.0, 245.0, 135.0, 110.0],
                        help="MiB of logits a chunk; the first is the one the others are compared with")
    parser.add_argument("--backend", default=None, help="a backend to pin (default: auto selection)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(shapes.DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=float, default=300.0, help="timed repetitions' total time a round")
    parser.add_argument("--out", type=Path, default=None, help="write the table (markdown) here too")
    a = parser.parse_args(argv)
    device = torch.device(a.device)
    preset = a.shape or ("llama3" if device.type == "cuda" else "tiny")
    rows = []
    for op in a.ops:
        for case in shapes.cases(op, [preset], a.n, None, [shapes.DTYPES[a.dtype]], ["fwd+bwd"]):
            rows.append((case, measure(case, a.budgets, a.backend, device, a.rounds, a.rep_ms)))
    run = env.collect(device, ["chunk-budgets", *(argv or [])])
    lines = [f"# Chunk budgets on {run.gpu} ({run.date}; driver {run.driver}; "
             + ", ".join(f"{k} {v}" for k, v in run.versions.items()) + ")", "", f"`{run.command}`", "", *table(rows)]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    if not agree(rows):
        print("a budget's loss or gradients differ from the first budget's beyond the dtype's tolerance")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
