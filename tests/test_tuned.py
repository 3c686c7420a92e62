"""Measured auto-selection: a tuned table reorders auto for its bucket only, on its own device and versions
only; preferences still win; explain names the entry; `python -m liger_dispatch tune` writes a table the
selector then reads (on the CPU, with the interpreted Triton and Helion backends, through tune.run: the command
itself refuses the CPU), and writes none when there is nothing to tune, nothing measured or no time left."""

import argparse
import json
import time

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch.tools import cli
from liger_dispatch import dispatch, settings, timing
from liger_dispatch.core import selection
from liger_dispatch.tuning import tune, tuned
from liger_dispatch.registry import cross_entropy

H, V = 16, 40


def flce_call(n):
    return torch.randn(n, H), torch.randn(V, H), torch.randint(0, V, (n,))


def write_table(path, entries, **key_changes):
    key = {**tuned.device_key(torch.device("cpu")), **key_changes}
    path.write_text(tuned.dumps({"format": tuned.FORMAT, "key": key, "entries": entries}))
    return path


def helion_first(n=16, bucket="v=64"):
    return {"op": "flce", "dtype": "float32", "n": n, "bucket": bucket, "shape": f"N={n} H={H} V={V}",
            "ms": {"triton": 2.0, "helion": 1.0}}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Points LIGER_TUNED_TABLE at a table file the test writes."""
    path = tmp_path / "table.json"
    monkeypatch.setenv(settings.TUNED_TABLE.name, str(path))
    return path


def auto_backend(n):
    return dispatch.op("flce").select(*flce_call(n)).backend


def test_static_order_without_a_table():
    assert auto_backend(16) == "triton"  # priority 20 before helion's 30 (interpreted on the CPU)


def test_entry_reorders_its_bucket_and_the_adjacent_one_only(table):
    write_table(table, [helion_first()])
    assert auto_backend(16) == "helion"  # n=16 v=64: the entry
    assert auto_backend(9) == "helion"  # 9 rounds up to 16
    assert auto_backend(32) == "helion"  # the adjacent power of two
    assert auto_backend(64) == "triton"  # two powers away: static priority
    assert dispatch.op("flce").select(torch.randn(16, H), torch.randn(200, H), torch.randint(0, 200, (16,))).backend \
        == "triton"  # another V bucket
    assert dispatch.op("flce").select(*flce_call(16), softcap=30.0).backend == "triton"  # another option bucket


def test_a_measured_difference_within_the_tie_margin_keeps_static_priority(table):
    near = dict(helion_first(), ms={"triton": 1.0 + tuned.TIE / 2, "helion": 1.0})
    write_table(table, [near])
    assert auto_backend(16) == "triton"  # helion is faster by less than TIE: priority decides
    assert "within 2%: helion, triton" in str(dispatch.op("flce").explain(*flce_call(16)))
    write_table(table, [dict(near, ms={"triton": 1.0 + 2 * tuned.TIE, "helion": 1.0})])
    selection.reset()  # the table file changed under the same name
    assert auto_backend(16) == "helion"


def test_preferences_win_over_the_table(table):
    write_table(table, [helion_first()])
    assert dispatch.op("flce", backend="triton").select(*flce_call(16)).backend == "triton"
    with ld.use_backend("triton"):
        assert auto_backend(16) == "triton"


@pytest.mark.parametrize("change", [{"device": "NVIDIA H200", "capability": [9, 0]}, {"torch": "2.11.0+cu130"},
                                    {"triton": None}])
def test_table_for_another_device_or_versions_is_ignored(table, change):
    write_table(table, [helion_first()], **change)
    assert auto_backend(16) == "triton"
    text = str(dispatch.op("flce").explain(*flce_call(16)))
    assert "tuned tables ignored here" in text and "made on" in text


def test_entry_measured_without_a_backend_that_serves_here_is_not_applied(table):
    write_table(table, [{**helion_first(), "ms": {"helion": 1.0}, "unavailable": {"triton": "not staged"}},
                        {**helion_first(), "ms": {"helion": 1.0}, "unavailable": {"cutedsl": "needs a CUDA device"},
                         "n": 64}])
    assert auto_backend(16) == "triton"
    assert "was measured without triton: static priority decides" in str(dispatch.op("flce").explain(*flce_call(16)))
    assert auto_backend(64) == "helion"  # cutedsl cannot serve CPU tensors anyway


def test_unreadable_table_is_ignored_with_its_reason(table):
    table.write_text("{not json")
    assert auto_backend(16) == "triton"
    assert "not a tuned table" in str(dispatch.op("flce").explain(*flce_call(16)))


def test_explain_names_the_entry_and_its_measurements(table):
    write_table(table, [helion_first()])
    text = str(dispatch.op("flce").explain(*flce_call(16)))
    assert "SELECTED (tuned: 1 ms measured)" in text
    assert f"tuned: helion is fastest in {table} entry (flce, float32, n=16 v=64)" in text
    assert "helion 1 ms, triton 2 ms" in text
    assert "no entry for (flce, float32, n=64 v=64)" in str(dispatch.op("flce").explain(*flce_call(64)))


def test_buckets_of_each_op():
    x = torch.randn(3, 5, 8)
    assert tuned.bucket_of("flce", (x, torch.randn(300, 8), None), {"label_smoothing": 0.1}) == (
        16, (("v", 512), ("smoothing", "on")))
    assert tuned.bucket_of("fused_linear_jsd", (x, torch.randn(300, 8), x, None), {"jsd_beta": 0.3})[1][1] == (
        "beta", "mixture")
    kl = tuned.bucket_of("fused_linear_kl_div", (x, torch.randn(300, 8), torch.zeros(15, 300, dtype=torch.bfloat16)),
                         {"log_target": True})
    assert kl == (16, (("v", 512), ("target", "bfloat16"), ("log_target", "on")))
    assert tuned.bucket_of("mhc_coeffs", (torch.randn(2, 3, 4, 24),), {}) == (8, (("hc", 4), ("c", 32)))
    assert tuned.bucket_of("fused_linear_logprobs", (x, torch.randn(300, 8), None), {"temperature": 0.7}) == (
        16, (("v", 512),))
    assert tuned.bucket_of("ce_loss_and_grad", (x,), {}) is None


def tune_args(*argv):
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    return parser.parse_args(["--ops", "flce", "--n", "8", "--hidden", str(H), "--vocab", str(V), "--reps", "1",
                              *argv])


def test_tune_writes_a_table_the_selector_reads(table, capsys):
    """The whole path on the CPU's interpreted backends (their times say nothing; the path is what is tested)."""
    assert tune.run(tune_args("--out", str(table)), "cpu", torch.float32, interpreted=True) == 0
    assert "wrote 1 entries" in capsys.readouterr().out
    key, entries = tuned.read_table(table)
    assert key == tuned.device_key(torch.device("cpu"))
    (entry,) = entries
    assert (entry["op"], entry["n"], entry["bucket"], set(entry["ms"])) == ("flce", 8, "v=64", {"triton", "helion"})
    assert set(entry["unavailable"]) == {"cutedsl"}
    fastest = min(entry["ms"], key=entry["ms"].get)
    assert auto_backend(8) == fastest
    explained = str(dispatch.op("flce").explain(*flce_call(8)))
    assert f"SELECTED (tuned: {entry['ms'][fastest]:.3g} ms measured)" in explained


def test_tune_measures_the_log_prob_op_with_upstream_gradients_on_both_outputs(table, capsys):
    args = tune_args("--out", str(table))
    args.ops = ["fused_linear_logprobs"]
    assert tune.run(args, "cpu", torch.float32, interpreted=True) == 0
    (entry,) = tuned.read_table(table)[1]
    assert (entry["op"], entry["n"], entry["bucket"], set(entry["ms"])) == (
        "fused_linear_logprobs", 8, "v=64", {"triton", "helion"})
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and "FAILED" not in out


def test_tune_on_the_cpu_says_there_is_nothing_to_tune_at_once(tmp_path, capsys):
    out = tmp_path / "table.json"
    start = time.monotonic()
    assert cli.main(["--device", "cpu", "tune", "--out", str(out)]) != 0  # the default set: llama3 heads
    assert time.monotonic() - start < 5
    assert "nothing to tune on the cpu" in capsys.readouterr().err
    assert not out.exists()


def test_tune_with_no_backend_but_the_reference_writes_nothing(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert tune.run(tune_args("--backends", "reference", "--out", str(out)), "cpu", torch.float32,
                    interpreted=True) != 0
    assert "no backend but the reference serves" in capsys.readouterr().err
    assert not out.exists()


def test_tune_whose_every_backend_fails_writes_no_table(isolated_table, tmp_path, capsys):
    def broken(input, weight, target, bias=None, ce_weight=None, *, ignore_index=-100, reduction="mean",
               label_smoothing=0.0, softcap=None, lse_square_scale=0.0, return_z_loss=False,
               return_token_accuracy=False, accum_dtype=None, process_group=None, need_grads=(), row_weights=None,
               logits_grad=False):
        raise RuntimeError("this kernel always fails")

    ld.register_backend("flce", backend="broken", priority=1 << 20,
                        capability=ld.Capability(devices=("cpu",)))(broken)
    out = tmp_path / "table.json"
    assert tune.run(tune_args("--backends", "broken", "--out", str(out)), "cpu", torch.float32, interpreted=True) != 0
    text = capsys.readouterr()
    assert "broken: FAILED (RuntimeError: this kernel always fails)" in text.out
    assert "no point was measured" in text.err
    assert not out.exists()


def test_tune_times_as_the_harness_does(table, capsys):
    """tune and the benchmark harness share their timing: the same defaults (warm-up, repetitions' time, rounds),
    the same step, and input copies rotated where one set would fit in L2 (as here: a tiny point on the CPU)."""
    from benchmarks import run as harness

    ours, theirs = tune_args(), harness.parse_args([])
    assert (ours.warmup_ms, ours.rep_ms, ours.rounds) == (theirs.warmup_ms, theirs.rep_ms, theirs.rounds) == (
        timing.WARMUP_MS, timing.REP_MS, timing.ROUNDS)
    point = next(cross_entropy.tune_points(8, H, V, torch.float32, torch.device("meta"), None))
    copies = timing.input_copies(point.inputs.nbytes(), timing.l2_bytes(torch.device("cpu")))
    assert copies > 1
    assert tune.run(tune_args("--out", str(table)), "cpu", torch.float32, interpreted=True) == 0
    assert f"(inputs rotated over {copies} sets)" in capsys.readouterr().out


def test_tune_stops_before_a_backend_the_budget_does_not_reach(tmp_path, capsys):
    """The budget is checked before each backend's measurement, from the same backend's last one at a smaller
    point: a point the budget cannot finish gets no entry (and no point runs past the budget)."""
    out = tmp_path / "table.json"
    budget = tune.Budget(0.0, reps=1, warmup_ms=0.0, rep_ms=0.0, rounds=1)
    point = next(cross_entropy.tune_points(8, H, V, torch.float32, torch.device("cpu"), None))
    assert budget.predict_s(point, "triton") == 0.0  # nothing measured yet
    budget.record(point, "triton", 10.0)
    assert budget.predict_s(point, "triton") == pytest.approx(10.0 * 4 / 1e3)  # check, estimate, warm-up, 1 rep
    assert tune.measure([point], ["triton"], torch.float32, torch.device("cpu"), budget, print) is None
    assert "not reached" in capsys.readouterr().out
    assert tune.run(tune_args("--budget-s", "0", "--out", str(out)), "cpu", torch.float32, interpreted=True) != 0
    assert not out.exists()


def test_a_point_too_large_for_the_free_memory_is_skipped_before_it_is_made(monkeypatch, capsys):
    monkeypatch.setattr(tune.timing, "host_free_bytes", lambda: 2**20)
    sized = list(cross_entropy.tune_points(4096, 64, 1000, torch.float32, torch.device("meta"), None))
    why = tune.too_large(sized, torch.device("cpu"))
    assert why.startswith("flce N=4096 H=64 V=1000: skipped: its inputs and gradients take")
    monkeypatch.setattr(tune.timing, "host_free_bytes", lambda: 2**40)
    assert tune.too_large(sized, torch.device("cpu")) is None


@pytest.mark.parametrize("build", ["2.13.1+cu128", "2.13.0"])
def test_a_table_applies_under_another_build_of_the_same_torch_minor(table, build):
    """The key is torch's major.minor: a table made with another patch level or CUDA build applies."""
    write_table(table, [helion_first()], torch=build)
    assert auto_backend(16) == "helion"


def test_a_key_written_with_torch_full_version_is_read_as_its_major_minor():
    key = tuned.device_key(torch.device("cpu"))
    assert key["torch"] == ".".join(torch.__version__.split(".")[:2])
    assert tuned.same_key(dict(key, torch=torch.__version__), key)
    assert not tuned.same_key(dict(key, torch="2.11.0+cu130"), key)
    assert not tuned.same_key(dict(key, triton="0.0.1"), key)


def test_each_committed_table_applies_on_its_gpu_under_any_build_of_its_torch_minor(monkeypatch):
    paths = tuned.table_files(())
    assert {p.name for p in paths} >= {"h200.json", "h100.json"}
    for path in paths:
        table_key, entries = tuned.read_table(path)
        assert table_key["torch"] == "2.11" and entries
        here = dict(table_key, torch="2.11.1+cu128")
        monkeypatch.setattr(tuned, "device_key", lambda device: here)
        tables = tuned.DeviceTables(tuned.device_key(None), paths)
        assert tables.applied == [str(path)] and len(tables.ignored) == len(paths) - 1, path
        assert tables.entry("flce", "bfloat16", 4096, (("v", 131072),)).fastest in ("triton", "cutedsl", "helion")


def test_a_merged_table_names_the_runs_that_measured_its_entries(table, capsys):
    """Tuning one op into an existing table keeps the other ops' entries and lists the runs written into it before."""
    assert tune.run(tune_args("--out", str(table)), "cpu", torch.float32, interpreted=True) == 0
    first = json.loads(table.read_text())
    assert "earlier" not in first
    args = tune_args("--out", str(table))
    args.ops = ["fused_linear_logprobs"]
    assert tune.run(args, "cpu", torch.float32, interpreted=True) == 0
    second = json.loads(table.read_text())
    assert {e["op"] for e in second["entries"]} == {"flce", "fused_linear_logprobs"}
    assert second["earlier"] == [{"written": first["written"], "command": first["command"]}]
    assert tune.run(args, "cpu", torch.float32, interpreted=True) == 0  # only its own entries replaced again
    assert json.loads(table.read_text())["earlier"] == [*second["earlier"], {"written": second["written"],
                                                                           "command": second["command"]}]
