"""python -m liger_dispatch: the backend matrix and the demos, on the CPU reference."""

import pytest

import pytest
import torch

from liger_dispatch.tools import cli
from liger_dispatch import dispatch


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


def test_matrix_fits_the_terminal_and_names_the_interpreters_on_the_cpu(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    monkeypatch.setenv("LIGER_BACKEND_FLCEE", "triton")
    for columns in (80, 90, 250):
        monkeypatch.setenv("COLUMNS", str(columns))
        assert cli.main(["--device", "cpu"]) == 0
        out = capsys.readouterr().out
        assert max(len(line) for line in out.splitlines()) <= columns
    assert "TRITON_INTERPRET=1" in out and "HELION_INTERPRET=1" in out  # in the triton and helion cells
    assert dispatch.backend_status("flce", "cpu", torch.float32)["triton"].endswith(
        "(runs on the CPU under TRITON_INTERPRET=1)")
    assert "LIGER_BACKEND_FLCEE is not a variable liger-dispatch reads" in out


def test_matrix_at_80_columns_is_one_line_per_op_with_whole_names_and_each_reason_once(capsys, monkeypatch):
    """The non-TTY default width: no op or backend name split, a short word per cell, each reason once below."""
    from liger_dispatch.core.table import TABLE

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ops = [name for name in TABLE.op_names() if not TABLE.spec(name).internal]  # the machinery's own: not shown
    backends = TABLE.backend_names()
    header = next(line for line in lines if line.split()[:1] == ["op"])
    assert header.split() == ["op", *backends]  # every backend name whole, on one line
    rows = {line.split()[0]: line.split()[1:] for line in lines if line.split()[:1] and line.split()[0] in ops}
    assert set(rows) == set(ops)  # every op name whole at the start of its row
    assert all(len(cells) == len(backends) for cells in rows.values())  # one line per op: a word per cell
    notes = [line for line in lines if line.startswith("(")]
    assert notes and all(cell in ("available", "-") or cell in {n.split()[0] for n in notes}
                         for cells in rows.values() for cell in cells)
    _, reasons = cli.matrix_rows("cpu", torch.float32)
    assert len(set(reasons)) == len(reasons) == len(notes)  # each reason once
    table_end = lines.index(notes[0])
    assert table_end <= len(ops) + 8, "\n".join(lines[:table_end])


@pytest.mark.parametrize("argv,problem", [
    (["--device", "foo"], "--device 'foo' is not a device"),
    (["demo", "--device", "mps"], "run on cpu or cuda devices"),
    pytest.param(["--device", "cuda"], "use --device cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_a_device_it_cannot_use_is_one_line_and_a_nonzero_exit(capsys, argv, problem):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and problem in err


def test_a_bad_environment_variable_is_one_line_and_a_nonzero_exit(capsys, monkeypatch):
    monkeypatch.setenv("LIGER_CHUNK_ROWS", "abc")
    assert cli.main(["--device", "cpu", "demo", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("python -m liger_dispatch: error: LIGER_CHUNK_ROWS='abc' is not valid: "
                           "expected a positive integer")


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
