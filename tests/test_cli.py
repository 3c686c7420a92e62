"""python -m liger_dispatch: the backend matrix and the demos, on the CPU reference."""

import pytest

from liger_dispatch import cli


def test_matrix_names_every_op_and_the_auto_choice(capsys):
    assert cli.main(["--device", "cpu", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    for op in ("flce", "fused_linear_jsd", "fused_linear_kl_div", "mhc_coeffs", "ce_loss_and_grad"):
        assert op in out
    assert "mhc_coeffs: auto picks " in out and "reference)" in out  # the reference is always usable, and last


def test_mhc_demo_trains_with_options_before_or_after_the_subcommand(capsys):
    assert cli.main(["--device", "cpu", "demo", "--model", "mhc", "--steps", "2"]) == 0
    assert cli.main(["demo", "--steps", "2", "--device", "cpu", "--dtype", "fp32", "--loss", "kl", "--model", "mhc"]) == 0
    out = capsys.readouterr().out
    assert out.count("step    1") == 2


def test_llama_demo_trains_distills_and_writes_its_png(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("LIGER_BACKEND", "reference")  # not the interpreted kernels conftest enables: seconds, not minutes
    png = tmp_path / "curves.png"
    assert cli.main(["demo", "--device", "cpu", "--steps", "3", "--loss", "kl", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "first step, patched (flce by reference) vs unpatched" in out and "logits not materialized" in out
    assert " ok\n" in out
    assert "student step    2  kl" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
