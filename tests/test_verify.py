"""liger_dispatch.testing and `python -m liger_dispatch verify`: CONTRIBUTING.md's example backend passes the
conformance suite, a deliberately wrong one fails it naming the case, an unknown backend is a clear error."""

import pytest

from liger_dispatch import testing
from liger_dispatch.errors import UnknownBackendError, UnknownOpError
from liger_dispatch.tools import cli
from test_contributing import section_code

EXAMPLE = section_code("Add a backend").split("\nx, w, y = ", 1)[0]  # the registration, not the usage lines
WRONG_SCALE = "logits.copy_(grad * scale.unsqueeze(1))"


def backend_file(tmp_path, name, code):
    assert WRONG_SCALE in EXAMPLE  # the example still writes its gradient where the wrong one changes it
    path = tmp_path / f"{name}.py"
    path.write_text(code)
    return str(path)


def test_contributing_example_passes_verify(isolated_table, tmp_path, capsys):
    """The whole command as a backend author runs it (in-process: the compile caches stay warm for the others)."""
    path = backend_file(tmp_path, "mine_ok", EXAMPLE)
    assert cli.main(["verify", "--backend", "mine", "--import", path, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for row in ("ce_loss_and_grad", "opcheck", "compile", "bias_3d_noncontiguous", "all_ignored"):
        assert row in out
    assert "mine on cpu:" in out and " 0 failed" in out


def test_a_wrong_gradient_fails_naming_the_case(isolated_table, tmp_path, capsys):
    wrong = EXAMPLE.replace(WRONG_SCALE, "logits.copy_(1.01 * grad * scale.unsqueeze(1))")  # 1% off
    path = backend_file(tmp_path, "mine_wrong", wrong)
    assert cli.main(["verify", "--backend", "mine", "--import", path, "--device", "cpu",
                     "--checks", "conformance"]) == 1
    out = capsys.readouterr().out
    assert "FAILED flce-mine-float32-mean: grad of input: relative error 1.00e-02 > 1.0e-03" in out
    assert "FAILED ce_loss_and_grad-mine-float32-sample: logits (written in place)" in out


def test_a_wrong_loss_fails_from_python(isolated_table, tmp_path):
    """liger_dispatch.testing.verify: a result object with every case; a loss off by 1e-2 fails its cases."""
    wrong = EXAMPLE.replace("return torch.where(valid, loss, 0.0)", "return torch.where(valid, loss + 1e-2, 0.0)")
    testing.load_module(backend_file(tmp_path, "mine_loss", wrong))
    result = testing.verify("mine", device="cpu", ops=["flce"], checks=["conformance"])
    assert not result.passed
    by_id = {c.id: c for c in result.cases}
    mean = by_id["flce-mine-float32-mean"]
    assert mean.status == "failed" and mean.error > mean.tolerance and "output 0" in mean.detail
    assert by_id["flce-mine-float16-smoothing"].status == "skipped"  # its capability: bf16 and fp32
    assert "flce-mine" in result.summary() and "failing:" in result.summary()


def test_unknown_backend_is_a_clear_error(isolated_table, capsys):
    with pytest.raises(UnknownBackendError, match="no op has a backend named 'nonexistent'.*registered backends: "
                                                  "reference"):
        testing.verify("nonexistent", device="cpu")
    assert cli.main(["verify", "--backend", "nonexistent", "--device", "cpu"]) != 0
    err = capsys.readouterr().err
    assert "error: no op has a backend named 'nonexistent'" in err and "Traceback" not in err


def test_an_unknown_op_is_a_clear_error():
    with pytest.raises(UnknownOpError, match="unknown op 'flec'"):
        testing.verify("reference", device="cpu", ops=["flec"])
