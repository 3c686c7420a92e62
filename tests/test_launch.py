"""Launch knobs (backends/_launch.py): set for a block of calls on one thread, outside the op's arguments."""

import threading
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from liger_dispatch.backends._launch import LaunchKnobs, given
from liger_dispatch.backends.triton import _support, ce, mhc


@dataclass(frozen=True)
class Knobs:
    block: Optional[int] = None
    warps: int = 4


def test_using_sets_restores_and_nests():
    launch = LaunchKnobs("test op", Knobs())
    assert launch.forced is None and launch.current is launch.default
    with launch.using(block=64) as knobs:
        assert knobs == launch.current == launch.forced == Knobs(block=64)
        with launch.using(warps=8):
            assert launch.current == Knobs(block=64, warps=8)
        assert launch.current == Knobs(block=64)
    assert launch.forced is None
    with pytest.raises(RuntimeError), launch.using(warps=2):
        raise RuntimeError
    assert launch.forced is None


def test_an_unknown_knob_is_named():
    with pytest.raises(TypeError, match="test op has no launch knob 'blok' \\(its knobs: block, warps\\)"):
        with LaunchKnobs("test op", Knobs()).using(blok=64):
            pass


def test_knobs_are_per_thread():
    launch = LaunchKnobs("test op", Knobs())
    seen = []
    with launch.using(block=64):
        thread = threading.Thread(target=lambda: seen.append(launch.current))
        thread.start()
        thread.join()
    assert seen == [Knobs()]


def test_given_is_the_set_knobs():
    assert given(None) == {} and given(Knobs(block=32)) == {"block": 32, "warps": 4}


def test_triton_ops_launch_with_the_knobs_in_effect(monkeypatch):
    seen = []
    monkeypatch.setattr(ce, "row_launch", lambda *args, knobs: seen.append(knobs) or {})
    monkeypatch.setattr(ce, "launch_row_kernel", lambda *args, **kwargs: None)
    logits, target = torch.randn(3, 8), torch.zeros(3, dtype=torch.int64)
    with ce.LAUNCH.using(block_size=16, num_stages=1):
        ce.ce_loss_and_grad(logits, target)
    ce.ce_loss_and_grad(logits, target)
    assert seen == [_support.RowLaunch(block_size=16, num_stages=1), _support.RowLaunch()]


def test_triton_mhc_plans_take_the_knobs_in_effect(monkeypatch):
    made = []
    monkeypatch.setattr(mhc, "_plan", lambda make, key, *args: made.append((make, args[-1])) or make(*args))
    monkeypatch.setattr(mhc, "_FwdPlan", lambda *args: type("Plan", (), dict(main=None))())
    x = torch.randn(0, 8)
    with mhc.FWD_LAUNCH.using(BM=16, split=2):
        mhc.mhc_coeff_fwd(x, torch.randn(8, 8), torch.randn(8), *torch.ones(3), hc=2)
    mhc.mhc_coeff_fwd(x, torch.randn(8, 8), torch.randn(8), *torch.ones(3), hc=2)
    assert [knobs for _, knobs in made] == [mhc.ForwardLaunch(BM=16, split=2), None]


@pytest.mark.gpu
def test_triton_row_kernels_launch_directly_from_a_signatures_second_call():
    """ce, jsd and kl_div's second call of a signature goes through the compiled kernel's launcher (_support.Launch),
    and gives what the reference gives on fresh inputs, as the first call (through Triton's launch) does; a pointer
    off a 16-byte boundary gets a compiled kernel of its own (Triton specializes on the alignment)."""
    from liger_dispatch import dispatch
    from liger_dispatch.backends.triton import jsd, kl_div

    def ce_args(call):  # the second pair of calls: a 0-d grad_scale 4 bytes past an aligned address, as a mean's is
        scale = torch.rand(5, device="cuda") if call < 2 else torch.rand(2, device="cuda")[1]
        return (torch.randn(5, 1000, device="cuda") * 3, torch.tensor([3, -100, 999, 0, 7], device="cuda")), dict(
            label_smoothing=0.1, grad_scale=scale)

    def teacher_args(call):
        return (torch.randn(5, 1000, device="cuda") * 3, torch.randn(5, 1000, device="cuda").softmax(-1)), {}

    for name, make, kernel, calls in (("ce_loss_and_grad", ce_args, ce._ce_kernel, 4),
                                      ("jsd_loss_and_grad", teacher_args, jsd._jsd_kernel, 2),
                                      ("kl_div_loss_and_grad", teacher_args, kl_div._kl_kernel, 2)):
        for call in range(calls):
            args, kwargs = make(call)
            expected = [t.clone() for t in args]
            loss = dispatch.op(name, backend="triton")(*args, **kwargs)
            want = dispatch.op(name, backend="reference")(*expected, **kwargs)
            assert torch.allclose(loss, want, rtol=1e-4, atol=1e-5), (name, call)
            assert torch.allclose(args[0], expected[0], rtol=1e-4, atol=1e-6), (name, call)  # the gradients
        launches = [v for k, v in _support._row_launches._values.items() if k[0] is kernel]
        assert launches and all(launch.compiled for launch in launches), name
