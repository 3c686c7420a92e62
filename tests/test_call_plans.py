"""A handle's repeated call reuses the plan of its signature (core/calls.py): it skips binding, the input checks and
selection, yet still honours a backend preference changed between calls, runs the label check on every call, replays
a fallback's warning or strict error, and gives the first call's results and gradients."""

import warnings

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import dispatch, settings
from liger_dispatch.core import calls, selection, torch_ops
from liger_dispatch.errors import BackendUnavailableError, FallbackWarning, InputError
from liger_dispatch.backends.reference import kl_div as reference_kl_div

from test_checks import flce_args, jsd_args, kl_args, mhc_args
from test_tuned import write_table

CPU = ld.Capability(devices=("cpu",))


@pytest.fixture
def planned(monkeypatch):
    """The number of calls that took the whole eager path (selection, value checks, a new plan)."""
    calls = []
    plan = torch_ops.plan
    monkeypatch.setattr(torch_ops, "plan", lambda *args: calls.append(args[0].name) or plan(*args))
    return calls


def _leaves(args: dict, differentiable) -> dict:
    """A fresh copy of the call's tensors, the differentiable ones requiring gradients."""
    return {k: v.detach().clone().requires_grad_(k in differentiable) if isinstance(v, torch.Tensor) else v
            for k, v in args.items()}


def _loss_and_grads(handle, args: dict, differentiable):
    args = _leaves(args, differentiable)
    out = handle(*args.values())
    outputs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outputs, [torch.randn_like(o) for o in outputs])
    return outputs, [args[name].grad for name in differentiable]


@pytest.mark.parametrize("op,make", [("flce", flce_args), ("fused_linear_jsd", jsd_args),
                                     ("fused_linear_kl_div", kl_args), ("mhc_coeffs", mhc_args)])
def test_a_repeated_call_takes_the_plan_and_equals_the_first(op, make, planned):
    handle = dispatch.op(op, backend="reference")
    differentiable = [n for n in handle._spec.differentiable if n in make()]
    args = make()
    torch.manual_seed(0)
    first = _loss_and_grads(handle, args, differentiable)
    torch.manual_seed(0)
    again = _loss_and_grads(handle, args, differentiable)
    assert planned == [op]  # the second call reused the first one's plan
    for got, want in zip([*again[0], *again[1]], [*first[0], *first[1]]):
        assert torch.isfinite(want).all()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():  # another signature: grad mode off, no autograd node
        assert handle(*args.values()) is not None
    assert planned == [op, op]


def _recording(name: str, seen: list):
    """The reference's KL kernel-level op as backend `name`, which appends its name to `seen` when it runs."""
    def kl_div_loss_and_grad(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                             log_target=False, grad_scale=None):
        seen.append(name)
        return reference_kl_div.kl_div_loss_and_grad(student_logits, target, labels, ignore_index=ignore_index,
                                                     temperature=temperature, eps=eps, log_target=log_target,
                                                     grad_scale=grad_scale)

    return kl_div_loss_and_grad


def test_use_backend_and_the_environment_are_read_on_every_call(isolated_table, monkeypatch, planned):
    """The same signature under another preference: another plan, the other backend."""
    seen = []
    for name in ("alpha", "beta"):
        ld.register_backend("kl_div_loss_and_grad", backend=name, priority=100, capability=CPU)(_recording(name, seen))
    handle, args = dispatch.op("fused_linear_kl_div"), kl_args()
    for backend in ("alpha", "beta", "alpha"):
        with ld.use_backend(backend):
            for _ in range(2):
                del seen[:]
                handle(*args.values())
                assert set(seen) == {backend}
    monkeypatch.setenv("LIGER_BACKEND_FUSED_LINEAR_KL_DIV", "beta")
    del seen[:]
    handle(*args.values())
    assert set(seen) == {"beta"}
    monkeypatch.setenv("LIGER_BACKEND_FUSED_LINEAR_KL_DIV", "alpha")
    del seen[:]
    handle(*args.values())
    assert set(seen) == {"alpha"}
    assert len(planned) == 4  # alpha, beta (use_backend), beta, alpha (environment): a plan each


def test_a_tuned_table_named_between_calls_reorders_auto_selection(isolated_table, tmp_path, monkeypatch, planned):
    seen = []
    for name in ("alpha", "beta"):
        ld.register_backend("kl_div_loss_and_grad", backend=name, priority=100, capability=CPU)(_recording(name, seen))
    handle, args = dispatch.op("fused_linear_kl_div"), kl_args()
    for fastest, slowest in (("alpha", "beta"), ("beta", "alpha")):
        entry = {"op": "fused_linear_kl_div", "dtype": "float32", "n": 8, "bucket": "v=16 target=float32",
                 "shape": "N=5 V=13", "ms": {fastest: 1.0, slowest: 2.0}}
        monkeypatch.setenv(settings.TUNED_TABLE.name, str(write_table(tmp_path / f"{fastest}.json", [entry])))
        for _ in range(2):
            del seen[:]
            handle(*args.values())
            assert set(seen) == {fastest}
    assert len(planned) == 2


def test_the_label_check_runs_on_every_call(planned):
    handle = dispatch.op("flce", backend="reference")
    args = flce_args()
    handle(*args.values())
    bad = dict(args, target=args["target"].clone())
    bad["target"][2] = bad["weight"].shape[0]  # same shape, dtype and device: the same signature
    with pytest.raises(InputError, match=r"target holds 13, outside \[0, 13\)"):
        handle(*bad.values())
    assert planned == ["flce"]
    handle(*args.values())


def test_a_fallback_warns_once_and_raises_under_strict_on_a_repeated_call(monkeypatch, planned):
    handle, args = dispatch.op("flce", backend="cutedsl"), flce_args()  # CuTeDSL needs CUDA: the reference serves
    with pytest.warns(FallbackWarning, match=r"cutedsl.*falling back to 'reference'"):
        handle(*args.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle(*args.values())  # warned once per reason already
    monkeypatch.setenv("LIGER_STRICT", "1")
    with pytest.raises(BackendUnavailableError, match="cutedsl"):
        handle(*args.values())
    assert planned == ["flce"]
    selection.reset()  # forgets the warnings given, and the plans
    monkeypatch.delenv("LIGER_STRICT")
    with pytest.warns(FallbackWarning):
        handle(*args.values())


def test_autocast_state_is_part_of_the_signature(planned):
    handle = dispatch.op("fused_linear_kl_div", backend="reference")
    args = kl_args()
    plain = handle(*args.values())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = [handle(*args.values()) for _ in range(2)]
    assert planned == ["fused_linear_kl_div"] * 2
    torch.testing.assert_close(cast[1], cast[0], rtol=0, atol=0)
    torch.testing.assert_close(cast[0], plain, rtol=2e-2, atol=2e-2)  # bf16 logits
    assert not torch.equal(cast[0], plain)


def test_unhashable_options_and_vocab_parallel_calls_are_not_remembered(planned):
    handle = dispatch.op("flce", backend="reference")
    args = flce_args()
    for _ in range(2):
        handle(*args.values(), label_smoothing=0.0)
    unhashable = calls.key(handle._spec, handle.pinned, tuple(args.values()), dict(label_smoothing=[0.0]))
    assert calls.get(unhashable) is None and calls.remember(unhashable, object()) is None
    assert calls.remember(("key",), object(), process_group="group") is None
    assert ("key",) not in calls._plans and planned == ["flce"]


def test_under_a_functorch_transform_the_function_is_applied_as_torch_applies_it():
    """The eager path skips autograd.Function.apply's Python wrapper only where it changes nothing: under a functorch
    transform a call meets torch's own answer (these Functions define no setup_context)."""
    handle, args = dispatch.op("fused_linear_kl_div", backend="reference"), kl_args()
    handle(*args.values())
    rest = list(args.values())[1:]
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: handle(x, *rest))(args["student_input"])


def test_the_torch_op_and_its_backward_op_select_once_per_signature(monkeypatch):
    """Compiled code calls torch.ops.liger_dispatch.<op> and, for an op with a backward of its own, <op>_backward:
    each takes the plan of its signature, selecting on the first call only (the backward as the forward planned)."""
    resolved = []
    resolve = selection.resolve
    monkeypatch.setattr(selection, "resolve", lambda op, *rest, **kw: resolved.append(op) or resolve(op, *rest, **kw))
    calls.reset()
    after_first = None
    for _ in range(3):
        args = _leaves(mhc_args(), ("x", "phi", "b"))
        coeffs = torch.ops.liger_dispatch.mhc_coeffs(*args.values(), tmax=3, backend="reference")[:3]
        torch.autograd.backward(coeffs, [torch.randn_like(c) for c in coeffs])
        assert all(torch.isfinite(args[n].grad).all() for n in ("x", "phi", "b"))
        after_first = after_first or list(resolved)
    assert resolved == after_first and 1 <= len(resolved) <= 2  # the forward's and the backward's first calls
