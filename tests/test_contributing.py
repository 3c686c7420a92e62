"""CONTRIBUTING.md's "Add a backend" walk-through, run as written: it registers, serves the user-level op through
dispatch, and agrees with the reference."""

import re
from pathlib import Path

import torch

from liger_dispatch import dispatch
from kernel_checks import assert_rel_close

CONTRIBUTING = Path(__file__).parents[1] / "CONTRIBUTING.md"


def section_code(title: str) -> str:
    """The python code blocks of the markdown section `## title`, joined in order."""
    text = CONTRIBUTING.read_text()
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, re.S))


def test_add_a_backend_example_registers_and_serves_flce(isolated_table, capsys):
    namespace = {}
    exec(compile(section_code("Add a backend"), str(CONTRIBUTING), "exec"), namespace)
    assert "mine [composed from ce_loss_and_grad]: SELECTED" in capsys.readouterr().out
    assert "mine" in dispatch.available_backends("flce", device="cpu", dtype=torch.float32)
    x, y = torch.randn(6, 16), torch.tensor([3, -100, 0, 7, 9, 1])
    w = torch.randn(10, 16) * 0.5
    options = dict(label_smoothing=0.2, softcap=2.0, lse_square_scale=1e-2, reduction="sum")

    def run(backend, dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (x, w)]
        loss = dispatch.op("flce", backend=backend)(*inputs, y, **options)
        loss.backward()
        return loss, *(t.grad for t in inputs)

    for name, got, want in zip(("loss", "input grad", "weight grad"), run("mine", torch.float32),
                               run("reference", torch.float64)):
        assert_rel_close(name, got, want, 1e-5)
