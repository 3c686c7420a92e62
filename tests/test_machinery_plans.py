"""The machinery's own kernel-level ops (registry/support.py) are selected once per signature of the call that runs
them (core/calls.py, Kernels): the label check a value check runs and each gradient's scale_grad in a loss's
backward. They still run on every call, with the op's fallback warning or strict error replayed; a backend
registered since, or selection.reset(), makes the next call select again. A handle's repeated call compares its key
with its last one's, and calls.reset() forgets that plan too."""

import warnings

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import dispatch
from liger_dispatch.backends.reference import support as reference_support
from liger_dispatch.core import calls, selection, torch_ops
from liger_dispatch.core.table import OpSpec
from liger_dispatch.errors import BackendUnavailableError, FallbackWarning
from liger_dispatch.registry import support

from test_checks import flce_args

CPU = ld.Capability(devices=("cpu",))


@pytest.fixture
def selected(monkeypatch):
    """The ops selection.selected was asked about, in order."""
    asked = []
    real = selection.selected
    monkeypatch.setattr(selection, "selected", lambda op, *args: asked.append(op) or real(op, *args))
    return asked


def _labelled(table, name: str):
    """A kernel-level op `name`(x, target) whose value check runs the machinery's label check (vocabulary 4)."""
    def value_check(a):
        support.run("check_class_indices", a.target, vocab=4, ignore_index=-100)

    table.declare_op(OpSpec(f"{name}(Tensor x, Tensor target) -> Tensor", "kernel", lambda a: None,
                            value_check=value_check, fake=lambda a: torch.empty_like(a.x)))
    ld.register_backend(name, backend="reference")(lambda x, target: x.clone())
    return dispatch.op(name)


def _spy_check(seen: list):
    def check_class_indices(target, *, vocab, ignore_index, name="target"):
        seen.append(target.shape)
        reference_support.check_class_indices(target, vocab=vocab, ignore_index=ignore_index, name=name)

    return check_class_indices


def test_a_value_checks_label_check_is_selected_once_and_runs_every_call(isolated_table, selected):
    run = _labelled(isolated_table, "labelled_once")
    x = torch.randn(3)
    for _ in range(3):
        run(x, torch.tensor([0, 3, -100]))
    assert selected.count("check_class_indices") == 1
    for _ in range(2):  # same signature, a bad label: the check runs and stops the call every time
        with pytest.raises(RuntimeError, match=r"target holds a class index outside \[0, 4\)"):
            run(x, torch.tensor([0, 4, 1]))
    seen = []
    ld.register_backend("check_class_indices", backend="spy", priority=1000, capability=CPU)(_spy_check(seen))
    run(x, torch.tensor([1, 2, 3]))  # registered since: selected again, the spy serves
    run(x, torch.tensor([1, 2, 3]))
    assert seen == [torch.Size([3])] * 2 and selected.count("check_class_indices") == 2
    selection.reset()
    run(x, torch.tensor([1, 2, 3]))
    assert selected.count("check_class_indices") == 3


def test_a_label_checks_fallback_is_replayed_on_every_call(isolated_table, monkeypatch):
    run = _labelled(isolated_table, "labelled_fallback")
    picky = ld.Capability(devices=("cpu",), predicate=lambda target, **kw: "never serves")
    ld.register_backend("check_class_indices", backend="picky", priority=1000, capability=picky)(_spy_check([]))
    x, target = torch.randn(3), torch.tensor([0, 1, 2])
    with pytest.warns(FallbackWarning, match=r"check_class_indices.*picky: never serves"):
        run(x, target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(x, target)  # warned once per reason already
    monkeypatch.setenv("LIGER_STRICT", "1")
    for _ in range(2):
        with pytest.raises(BackendUnavailableError, match="check_class_indices"):
            run(x, target)


def _flce_backward(handle, args):
    leaves = {k: v.detach().clone().requires_grad_(k in ("input", "weight")) for k, v in args.items()}
    handle(*leaves.values()).mul(2.0).backward()
    return leaves["input"].grad, leaves["weight"].grad


def test_the_backward_scale_is_selected_once_per_signature(isolated_table, selected):
    handle, args = dispatch.op("flce", backend="reference"), flce_args()
    want = _flce_backward(handle, args)
    assert selected.count("scale_grad") == 2  # the input's gradient and the weight's: two signatures
    for _ in range(2):
        got = _flce_backward(handle, args)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert selected.count("scale_grad") == 2
    seen = []

    def scale_grad(grad, grad_loss):
        seen.append(grad.shape)
        reference_support.scale_grad(grad, grad_loss)

    ld.register_backend("scale_grad", backend="spy", priority=1000, capability=CPU)(scale_grad)
    got = _flce_backward(handle, args)  # registered since: the next backward selects again, the spy serves
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert seen == [args["input"].shape, args["weight"].shape] and selected.count("scale_grad") == 4


def test_a_compositions_mean_count_is_kept_by_the_plan(isolated_table, selected, monkeypatch):
    """valid_rows, which a mean's composition runs for its divisor, is kept by the plan as a value check's label check
    is: looked up on the signature's first call only (no call-signature key of its own on the later ones), eager and
    through the torch op alike, and selected again after a registration."""
    keyed = []
    key = calls.key
    monkeypatch.setattr(calls, "key", lambda spec, *args: keyed.append(spec.name) or key(spec, *args))
    handle, args = dispatch.op("flce", backend="reference"), flce_args()
    want = handle(*args.values())
    op = torch.ops.liger_dispatch.flce
    for _ in range(3):
        torch.testing.assert_close(handle(*args.values()), want, rtol=0, atol=0)
        torch.testing.assert_close(op(*args.values(), backend="reference")[0], want, rtol=0, atol=0)
    assert keyed.count("valid_rows") == 2 and selected.count("valid_rows") == 1  # each plan's first call
    seen = []

    def valid_rows(target, *, ignore_index, scale=1.0, losses=None):
        seen.append(target.shape)
        return reference_support.valid_rows(target, ignore_index=ignore_index, scale=scale, losses=losses)

    ld.register_backend("valid_rows", backend="spy", priority=1000, capability=CPU)(valid_rows)
    for _ in range(2):  # registered since: selected again, the spy serves every call
        torch.testing.assert_close(handle(*args.values()), want, rtol=0, atol=0)
    assert seen == [args["target"].shape] * 2 and selected.count("valid_rows") == 2


def test_forgotten_plans_are_forgotten_by_the_handle_too(monkeypatch):
    planned = []
    plan = torch_ops.plan
    monkeypatch.setattr(torch_ops, "plan", lambda *args: planned.append(args[0].name) or plan(*args))
    handle, args = dispatch.op("flce", backend="reference"), flce_args()
    for _ in range(2):
        handle(*args.values())
    calls.reset()
    handle(*args.values())
    assert planned == ["flce", "flce"]
