"""The RL peers of the benchmark harness on the CPU: verl's fused log-prob kernel as the peer of fused_linear_logprobs
(loaded from its files; its kernels need CUDA), and `rl-losses`, whole GRPO and DPO losses, at a tiny shape."""

import importlib.util
import sys

import pytest
import torch

from benchmarks import peers, providers, rl_losses

CPU = torch.device("cpu")
needs_verl = pytest.mark.skipif(importlib.util.find_spec("verl") is None,
                                reason="verl is not installed (pip install --no-deps verl==0.9.1)")
needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                                 reason="liger-kernel is not installed (pip install liger-kernel==0.8.5)")


def test_verl_says_why_it_cannot_run(monkeypatch):
    """Not installed, or (installed) no CUDA device: the harness lists verl among fused_linear_logprobs' providers it
    skips, with the reason."""
    installed = importlib.util.find_spec("verl") is not None
    _, skipped = providers.resolve("fused_linear_logprobs", CPU, torch.bfloat16, ["torch", "verl"])
    assert skipped == [("verl", "needs a CUDA device" if installed else peers.not_installed("verl"))]
    monkeypatch.setitem(sys.modules, "verl", None)  # what an absent verl looks like to the import system
    assert peers.unavailable("verl", CPU) == "not installed: ModuleNotFoundError: No module named 'verl'"


@needs_verl
def test_verl_loads_from_its_files_and_declines_what_it_lacks():
    """Its two kernel files import without verl/__init__.py (which needs verl's whole runtime); a bias or an H that is
    not a multiple of 128 is Unsupported; on the CPU its host code refuses to run."""
    module = peers._load_verl()
    assert module.__name__ == "verl.utils.kernel.linear_cross_entropy"
    assert sys.modules["verl"].__file__ is None  # the stand-in package, not verl's own
    assert not sys.modules["verl.utils.kernel.kernels"].SUPPORT_CUDA_TMA
    logprobs = peers.PEERS["verl"].adapter("fused_linear_logprobs")
    x, w, target = torch.randn(4, 128), torch.randn(32, 128), torch.tensor([1, -100, 3, 4])
    with pytest.raises(peers.Unsupported, match="bias"):
        logprobs(x, w, target, torch.zeros(32))
    with pytest.raises(peers.Unsupported, match="multiple of 128"):
        logprobs(x[:, :64], w[:, :64], target)
    with pytest.raises((AssertionError, RuntimeError)):  # NVTX without CUDA, or its assert on CUDA tensors
        logprobs(x, w, target, temperature=0.9)


def _rows(out):
    """{(loss, provider): the row's cells} of an rl-losses markdown file of one N."""
    rows, loss = {}, None
    for line in out.read_text().splitlines():
        if line.startswith("## "):
            loss = line[3:]
        elif loss and line.startswith("|  | "):  # a table row (the size column is empty: one N, in the heading)
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(loss, cells[1])] = cells
    return rows


def _run(tmp_path, *argv):
    out = tmp_path / "rl.md"
    assert rl_losses.main(["--n", "16", "--rep-ms", "1", "--warmup-ms", "1", "--out", str(out), *argv]) == 0
    return _rows(out)


def _agree(rows, expected):
    """Every expected row timed, its loss and gradients within bf16's tolerance of the fp32 loss."""
    assert set(rows) == expected, rows
    for cells in rows.values():
        assert float(cells[2]) > 0, cells
        out_err, grad_err = map(float, cells[6].split(" / "))
        assert out_err < 1e-2 and grad_err < 1e-2, cells


def test_rl_losses_ours_torch_and_compile_agree(tmp_path, monkeypatch):
    """rl-losses at the tiny head: ours, torch and torch.compile pass the check against the fp32 loss and are timed
    (torch.compile for GRPO only: its compilation is most of this test's time; ours on the reference backend, not the
    interpreted kernels conftest enables: seconds, not a minute)."""
    monkeypatch.setenv("LIGER_BACKEND", "reference")
    rows = _run(tmp_path, "--losses", "grpo", "--providers", "ours", "torch", "torch.compile")
    _agree(rows, {("grpo", p) for p in ("ours", "torch", "torch.compile")})
    rows = _run(tmp_path, "--losses", "dpo", "--providers", "ours", "torch")
    _agree(rows, {("dpo", p) for p in ("ours", "torch")})


@needs_liger
def test_rl_losses_liger_rows(tmp_path):
    """liger-kernel's fused GRPO and DPO losses, with the same settings, pass the same check."""
    _agree(_run(tmp_path, "--providers", "liger-kernel"), {("grpo", "liger-kernel"), ("dpo", "liger-kernel")})
