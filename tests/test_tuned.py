"""Measured auto-selection: a tuned table reorders auto for its bucket only, on its own device and versions
only; preferences still win; explain names the entry; `python -m liger_dispatch tune` writes a table the
selector then reads (on the CPU, with the interpreted Triton and Helion backends)."""

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch.tools import cli
from liger_dispatch import dispatch, settings
from liger_dispatch.core import selection
from liger_dispatch.tuning import tuned

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
    assert tuned.bucket_of("ce_loss_and_grad", (x,), {}) is None


def test_tune_command_writes_a_table_the_selector_reads(table, capsys):
    args = ["--device", "cpu", "tune", "--ops", "flce", "--n", "8", "--hidden", str(H), "--vocab", str(V),
            "--reps", "1", "--warmup", "0", "--out", str(table)]
    assert cli.main(args) == 0
    assert "wrote 1 entries" in capsys.readouterr().out
    key, entries = tuned.read_table(table)
    assert key == tuned.device_key(torch.device("cpu"))
    (entry,) = entries
    assert (entry["op"], entry["n"], entry["bucket"], set(entry["ms"])) == ("flce", 8, "v=64", {"triton", "helion"})
    assert set(entry["unavailable"]) == {"cutedsl"}
    fastest = min(entry["ms"], key=entry["ms"].get)
    assert auto_backend(8) == fastest
    assert f"SELECTED (tuned: {entry['ms'][fastest]:.3g} ms measured)" in str(dispatch.op("flce").explain(*flce_call(8)))
