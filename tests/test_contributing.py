"""The code in the docs, run as written: README.md's quickstart, and CONTRIBUTING.md's "Add a backend" walk-through
(it registers, serves the user-level op through dispatch, and agrees with the reference); the README's test command
is the one .ci/run runs."""

import re
from pathlib import Path

import torch

from liger_dispatch import dispatch
from kernel_checks import assert_rel_close

ROOT = Path(__file__).parents[1]
CONTRIBUTING, README = ROOT / "CONTRIBUTING.md", ROOT / "README.md"


def section_code(title: str, doc: Path = CONTRIBUTING, language: str = "python") -> str:
    """The code blocks of the markdown section `## title` of `doc`, joined in order."""
    text = doc.read_text()
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(rf"```{language}\n(.*?)```", section, re.S))


def test_readme_quickstart_runs_as_pasted(capsys):
    """Self-contained: every name it uses is defined in it (a fresh namespace), and its numbers are torch's."""
    exec(compile(section_code("Quickstart", README), str(README), "exec"), {})
    out = capsys.readouterr().out
    flce, torch_ce = re.search(r"flce (\S+), torch (\S+)", out).groups()
    assert abs(float(flce) - float(torch_ce)) < 1e-4
    assert "SELECTED" in out and "usable here, best first: [" in out


def test_readme_test_command_is_what_ci_runs():
    command = section_code("Two commands on a fresh machine", README, "bash").strip().splitlines()[-1]
    assert command.startswith("pip install -q ") and command.endswith("python -m pytest -q")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == command


def test_add_a_backend_example_registers_and_serves_flce(isolated_table, capsys):
    namespace = {}
    exec(compile(section_code("Add a backend"), str(CONTRIBUTING), "exec"), namespace)
    assert "mine [composed from ce_loss_and_grad]: SELECTED" in capsys.readouterr().out
    assert "mine" in dispatch.available_backends("flce", device="cpu", dtype=torch.float32)
    x, y = torch.randn(6, 16), torch.tensor([3, -100, 0, 7, 9, 1])
    w = torch.randn(10, 16) * 0.5
    options = dict(label_smoothing=0.2, softcap=2.0, lse_square_scale=1e-2, return_z_loss=True,
                   return_token_accuracy=True)

    def run(backend, dtype, **more):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (x, w)]
        out = dispatch.op("flce", backend=backend)(*inputs, y, None, torch.rand(10) + 0.5, **options, **more)
        out.loss.sum().backward()
        return *out, *(t.grad for t in inputs)

    names = ("loss", "z_loss", "accuracy", "input grad", "weight grad")
    for reduction in ("sum", "none"):
        torch.manual_seed(0)
        mine = run("mine", torch.float32, reduction=reduction)
        torch.manual_seed(0)
        for name, got, want in zip(names, mine, run("reference", torch.float64, reduction=reduction)):
            assert_rel_close(name, got, want, 1e-5)
