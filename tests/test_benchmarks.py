"""The benchmark harness end to end on the CPU: the tiny preset of every op through the real CLI.

The CLI runs in a subprocess: dispatch_overhead registers a backend for the life of its process,
which must not leak into the registry the other tests see.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import report, vocab_parallel
from benchmarks.shapes import OPS

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("op", "shape", "n", "dtype", "provider", "mode", "ms", "ms_p20", "ms_p80", "peak_mb", "x_roofline")


def test_tiny_preset_writes_csv_markdown_and_plots(tmp_path):
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.run", "--ops", *OPS, "--shapes", "tiny", "--providers", "torch",
               "ours", "--rep-ms", "1", "--warmup-ms", "1", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    with (out / "cpu.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        assert set(REQUIRED) <= set(reader.fieldnames)
        rows = list(reader)
    assert {r["op"] for r in rows} == set(OPS)
    timed = [r for r in rows if r["op"] != "dispatch_overhead"]
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 and float(r["x_roofline"]) > 0 for r in timed), timed
    assert {r["provider"] for r in timed} == {"torch", "ours"}  # ours: auto selection, as a user calls it
    assert all(r["command"].startswith("python -m benchmarks.run") and r["date"] for r in rows)

    markdown = (out / "cpu.md").read_text()
    for op in OPS:
        assert f"## {op}" in markdown
    assert len(list(out.glob("cpu_*.png"))) == len(OPS) - 1  # one per op with a shape sweep

    # A warm-L2 run keeps its rows beside the flushed ones (its own mode).
    warm = [sys.executable, "-m", "benchmarks.run", "--ops", "flce", "--shapes", "tiny", "--providers", "torch",
            "--rep-ms", "1", "--warmup-ms", "1", "--warm", "--out", str(out)]
    done = subprocess.run(warm, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    modes = {r["mode"] for r in report.read_csv(out / "cpu.csv") if r["op"] == "flce"}
    assert modes == {"fwd+bwd", "fwd+bwd-warm"}, modes
    assert "fwd+bwd-warm" in (out / "cpu.md").read_text()
    rows = report.read_csv(out / "cpu.csv")

    # Later invocations merge into the same file, replacing the rows of the same key.
    remeasured = dict(rows[0], ms="1.5")
    report.merge_csv(out / "cpu.csv", [remeasured, dict(rows[0], n="999999")])
    merged = report.read_csv(out / "cpu.csv")
    assert len(merged) == len(rows) + 1
    assert [r["ms"] for r in merged if r == remeasured] == ["1.5"]


def test_vocab_parallel_script_runs_on_a_gloo_group_of_one(tmp_path):
    """benchmarks.vocab_parallel in this process on the CPU (its GPU rows come from the H200): every op's row, with
    the vocab-parallel path agreeing with the single-process op."""
    out = tmp_path / "vp.md"
    args = ["--device", "cpu", "--n", "16", "--hidden", "32", "--vocab", "101", "--backends", "reference",
            "--rep-ms", "1", "--out", str(out)]
    assert vocab_parallel.main(args) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| f")]
    assert sorted(r[0] for r in rows) == ["| flce", "| fused_linear_jsd", "| fused_linear_kl_div"]
    assert all(float(err.strip(" |")) < 1e-5 for r in rows for err in r[-3:]), rows


def test_host_cost_runs_on_the_cpu(tmp_path):
    """host-cost through the harness's entry point, end to end at its quick shapes: a row per loss op and provider,
    mHC's rows (PyTorch's own floor first), the tiny-shape flce rows beside torch's cross-entropy, and the profiles:
    each noop handle call's, then the tiny auto call's, which the noop backend (registered later) does not serve."""
    out = tmp_path / "host_cost.md"
    command = [sys.executable, "-m", "benchmarks.run", "host-cost", "--device", "cpu", "--quick", "--backends",
               "reference", "--profile", "5000", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    for op in ("flce", "fused_linear_jsd", "fused_linear_kl_div"):
        assert f"| {op} | noop |" in text and f"| {op} | reference |" in text
    assert all(f"| 8 x 16 | {p} |" in text for p in ("torch floor", "floor", "reference"))
    assert "| torch |" in text and "| 1.00x | 1.00x |  |" in text and "| ours |" in text
    profiles = text.split("## Where a call's host time goes")[1]
    noop, tiny = profiles.split("### flce auto at")[0], profiles.split("### flce auto at")[1:]
    assert all(f"### {op}, 3 noop handle calls" in noop for op in ("flce", "fused_linear_jsd", "fused_linear_kl_div"))
    assert "dispatch.py" in noop and "noop" in noop  # every frame of the call is listed (K = 5000: all of them,
    # whichever backend auto picks for the tiny call; under an interpreter its frames are hundreds)
    assert len(tiny) == 2 and all("cross_entropy.py" in t and "noop" not in t for t in tiny)


def test_chunk_budgets_compares_each_budget_with_the_first(tmp_path):
    """chunk-budgets on the CPU (reference backend): 130 rows as one chunk and as three (64-row chunks at 0.2 MiB of
    fp32 logits), each budget's loss and gradients checked against the first's, for every LM-head loss."""
    from benchmarks import chunk_budgets

    out = tmp_path / "budgets.md"
    args = ["--ops", "flce", "fused_linear_jsd", "fused_linear_kl_div", "--n", "130", "--dtype", "fp32",
            "--budgets", "2", "0.2", "--rounds", "2", "--rep-ms", "1", "--backend", "reference", "--device", "cpu",
            "--out", str(out)]
    assert chunk_budgets.main(args) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| f")]
    assert [(r[0].strip("| "), r[2], r[4]) for r in rows] == [
        (op, budget, chunks) for op in ("flce", "fused_linear_jsd", "fused_linear_kl_div")
        for budget, chunks in (("2", "1"), ("0.2", "3"))]
    assert "LIGER_CHUNK_BUDGET_MB" not in os.environ


def test_triton_loss_kernel_cases_match_the_formulas():
    """Every Triton case of benchmarks/loss_kernels.py (kernel variants included) passes its own check, at a
    tiny shape on the CPU: the GPU run times only what is right."""
    import torch

    from benchmarks import loss_kernels as bench

    for name, reads, writes, make, run, reference_rows, launch, knobs in bench.cases(3, 300, torch.bfloat16, dev="cpu"):
        inputs = make()
        with launch.using(**knobs, block_size=64):
            assert bench.check(name, inputs, run, reference_rows, 1.0 / 3), name
        model, minimum = bench.traffic(inputs, reads, writes)
        assert model >= minimum > 0


def test_every_measurement_is_a_subcommand_of_the_harness():
    """Each module the harness names runs as `python -m benchmarks.run NAME` and takes an argv."""
    import importlib
    import inspect

    from benchmarks import run

    for name, (module, _) in run.TOOLS.items():
        main = importlib.import_module(module).main
        assert list(inspect.signature(main).parameters) == ["argv"], name


def test_kernel_times_groups_by_name_in_launch_order():
    """kernel-times sums a step's kernels by name, first launch first; on the CPU it says there is no profile."""
    from benchmarks import kernel_times

    events = [("gemm", 5.0), ("loss", 1.0), ("gemm", 3.0), ("memset", 0.5)]
    assert kernel_times.grouped(events) == [("gemm", 2, 8.0), ("loss", 1, 1.0), ("memset", 1, 0.5)]
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, "-m", "benchmarks.run", "kernel-times", "--shape", "tiny", "--n", "16"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "no CUDA device" in done.stdout, done.stdout + done.stderr


def test_float64_truth_checks_every_provider_against_the_formula_in_float64(tmp_path):
    """--truth float64: the error columns are the distance to the formula in float64 on the same inputs, so the torch
    provider (otherwise the reference itself, with no error) gets a bf16-sized error too, and each row says so."""
    from benchmarks import run

    out = tmp_path / "results"
    argv = ["--ops", "fused_linear_logprobs", "--shapes", "tiny", "--providers", "torch", "ours", "--rep-ms", "1",
            "--warmup-ms", "1", "--out", str(out)]
    assert run.main([*argv, "--truth", "float64"]) == 0
    rows = report.read_csv(out / "cpu.csv")
    assert {r["provider"] for r in rows} == {"torch", "ours"}
    for r in rows:
        assert r["status"] == "ok" and "errors against float64" in r["note"], r
        assert 0 < float(r["err_out"]) < 1e-2 and 0 < float(r["err_grad"]) < 1e-2, r
    assert run.main(argv) == 0  # the formula in bf16: torch is the reference, with no error of its own
    torch_rows = [r for r in report.read_csv(out / "cpu.csv") if r["provider"] == "torch"]
    assert torch_rows and all(r["err_out"] == "" and "float64" not in r["note"] for r in torch_rows), torch_rows


def test_a_step_takes_the_input_sets_in_turn_and_the_rounds_calls_are_counted():
    from liger_dispatch import timing

    seen = []
    leaves = [torch.tensor([float(i)], requires_grad=True) for i in range(3)]
    sets = [timing.Inputs((t,), {}, [t]) for t in leaves]

    def fn(t):
        seen.append(t.item())
        return (2 * t).sum()

    step = timing.step(fn, sets)
    for _ in range(5):
        step()
    assert seen == [0.0, 1.0, 2.0, 0.0, 1.0]
    assert all(t.grad is not None for t in leaves)
    # 4 ms a call, 25 ms of warm-up, 100 ms of repetitions over 5 rounds: each round an estimate and 5 repetitions,
    # the first also round(25 / 4) = 6 warm-up calls, the others one
    assert timing.calls(4.0, warmup_ms=25.0, rep_ms=20.0, min_reps=1) == (6, 5)
    assert timing.rounds_calls(4.0, 5, warmup_ms=25.0, rep_ms=100.0, min_reps=5) == (1 + 6 + 5) + 4 * (1 + 1 + 5)
    assert timing.input_copies(10 * 2**20, 50 * 2**20) == 8 and timing.input_copies(2**30, 50 * 2**20) == 1


def test_rounds_time_the_providers_in_turn_with_the_order_rotated():
    """--rounds: every provider is timed once a round, a round's first provider moving on by one, and each row's
    timing pools its samples over all rounds."""
    import math

    from benchmarks import measure, shapes
    from benchmarks.providers import Provider, formula

    case = shapes.cases("flce", ["tiny"], None, None, [torch.float32], ["fwd+bwd"])[0]
    timed = []

    def provider(name):
        def build(case):
            eager = formula(case.op)

            def call(*args, **kwargs):
                timed.append(name)
                return eager(*args, **kwargs)

            return call

        return Provider(name, build)

    rows = {}
    settings = measure.Settings(torch.device("cpu"), warmup_ms=0.0, rep_ms=0.0, max_row_s=math.inf,
                                deadline=math.inf, l2_bytes=0, rounds=3)
    measure.measure_case(case, [provider("a"), provider("b"), provider("c")], settings, measure.History(),
                         lambda p, outcome: rows.setdefault(p.name, outcome))
    assert {name: o.status for name, o in rows.items()} == {"a": "ok", "b": "ok", "c": "ok"}
    assert all("providers interleaved over 3 rounds" in o.notes for o in rows.values())
    runs = [name for i, name in enumerate(timed) if i == 0 or timed[i - 1] != name]
    assert runs == list("abc" + "abc" + "bca" + "cab"), timed  # the checks, then the rounds


def test_the_table_parts_commands_parse_with_the_harness_options(tmp_path):
    """benchmarks/table.sh, dry run: each part's every command parses with its tool's own options (a renamed flag,
    op or provider fails here, not on the GPU host), the tests it names exist, and an unknown part is refused."""
    import argparse
    import shlex

    from benchmarks import hf_step, host_cost, run
    from liger_dispatch.tuning import tune

    def table(part):
        return subprocess.run(["bash", "benchmarks/table.sh", part], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path)})

    parsed = []
    for part in ("tune", "flce-jsd", "kl-mhc", "host-step"):
        done = table(part)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert lines, part
        for line in lines:
            argv = shlex.split(line)
            assert argv[:2] == ["python3", "-m"], line
            module, args = argv[2], argv[3:]
            if module == "liger_dispatch" and args[0] == "tune":
                parser = argparse.ArgumentParser()
                tune.add_arguments(parser)
                parsed.append(parser.parse_args(args[1:]))
            elif module == "benchmarks.run" and args[0] == "host-cost":
                parsed.append(host_cost.parse_args(args[1:]))
            elif module == "benchmarks.run" and args[0] == "hf-step":
                parsed.append(hf_step.parse_args(args[1:]))
            elif module == "benchmarks.run":
                parsed.append(run.parse_args(args))
            else:
                assert module == "pytest", line
                files = [a for a in args if a.startswith("tests/")]
                assert files and all((ROOT / f).is_file() for f in files), line
    assert len(parsed) == 6
    assert all(str(tmp_path) in str(p.out) for p in parsed)
    refused = table("everything")
    assert refused.returncode == 2 and "usage" in refused.stderr
