"""python -m liger_dispatch: the backend matrix and the demo, on the CPU reference."""

from liger_dispatch import cli


def test_matrix_names_every_op_and_the_auto_choice(capsys):
    assert cli.main(["--device", "cpu", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    for op in ("flce", "fused_linear_jsd", "fused_linear_kl_div", "mhc_coeffs", "ce_loss_and_grad"):
        assert op in out
    assert "mhc_coeffs: auto picks " in out and "reference)" in out  # the reference is always usable, and last


def test_demo_trains_with_options_before_or_after_the_subcommand(capsys):
    assert cli.main(["--device", "cpu", "demo", "--steps", "2"]) == 0
    assert cli.main(["demo", "--steps", "2", "--device", "cpu", "--dtype", "fp32", "--loss", "kl"]) == 0
    out = capsys.readouterr().out
    assert out.count("step    1") == 2
