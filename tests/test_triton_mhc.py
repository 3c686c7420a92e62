"""The Triton mHC coefficient kernels against float64 autograd of the reference formulas: the five forward
outputs and all six gradients, every launch path (fused and split-K forward; grouped and single-group
MM backward; several producer blocks), missing upstream gradients, determinism.

On the CPU they run under TRITON_INTERPRET=1 with tiny shapes and forced small tiles; `pytest -m gpu` adds
the real shapes (B=4, HC=4, T*C = 512*1024 and 2048*4096, bf16).
"""

import contextlib
import functools
import os
import subprocess
import sys

import pytest
import torch

from liger_dispatch.backends.triton import _support, mhc
from kernel_checks import rel_err
from mhc_checks import (GRAD_NAMES, MISSING_GRADS, MISSING_GRADS_IDS, OPTIONS, REL_TOL, check_empty_batch, check_mhc,
                        inputs, upstream)


# tiny tiles so that CPU shapes cross every block boundary, split K and group the MM backward's rows
SPLIT_FWD = dict(BM=16, BK=16, split=2)
GROUPED_BWD = dict(BM=16, BK=16, groups=2, BR=4)


@contextlib.contextmanager
def launch(fwd_config=None, bwd_config=None):
    """Forward and backward launched with these knobs (ForwardLaunch / BackwardLaunch fields) set."""
    with mhc.FWD_LAUNCH.using(**(fwd_config or {})), mhc.BWD_LAUNCH.using(**(bwd_config or {})):
        yield


def run(m, hc, c, tmax, dtype=torch.float32, present=(True, True, True), fwd_config=None, bwd_config=None,
        x_row_stride=None, phi_dtype=None, **checks):
    with launch(fwd_config, bwd_config):
        return check_mhc(mhc, m, hc, c, tmax, dtype, present, x_row_stride, phi_dtype, **checks)


# ---------------------------------------------------------------- CPU (interpreter), tiny shapes


@pytest.mark.parametrize("tmax", [1, 3])
@pytest.mark.parametrize("hc,c", [(2, 16), (4, 8)])
@pytest.mark.parametrize("m", [1, 7])
def test_matches_float64(m, hc, c, tmax):
    run(m, hc, c, tmax)


@pytest.mark.parametrize("hc,c", [(2, 16), (4, 8)])
def test_split_k_forward_and_grouped_backward(hc, c):
    run(37, hc, c, 3, fwd_config=SPLIT_FWD, bwd_config=GROUPED_BWD)


def test_many_producer_blocks():
    """More producer blocks than the reducer takes in one step (its loop runs twice)."""
    run(69, 2, 8, 2, bwd_config=dict(BR=2))


def test_hc8():
    run(5, 8, 2, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    run(9, 4, 8, 3, dtype, x_row_stride=40, fwd_config=SPLIT_FWD, bwd_config=GROUPED_BWD)


def test_mixed_dtypes():
    """bf16 x with fp32 phi: both multiplied in fp32."""
    run(9, 4, 8, 3, torch.bfloat16, phi_dtype=torch.float32, fwd_config=SPLIT_FWD, bwd_config=GROUPED_BWD)


@pytest.mark.parametrize("present", MISSING_GRADS, ids=MISSING_GRADS_IDS)
def test_missing_upstream_gradients(present):
    run(6, 4, 8, 3, present=present)


def test_strided_inputs():
    """x rows wider than K, upstream gradients that are non-contiguous views."""
    m, hc = 5, 4
    grads = [g.transpose(0, -1).contiguous().transpose(0, -1) for g in upstream(m, hc)]
    assert not grads[2].is_contiguous()
    run(m, hc, 8, 3, x_row_stride=hc * 8 + 8, grads=grads)


def test_backward_is_deterministic():
    run(37, 4, 8, 3, bwd_config=GROUPED_BWD, deterministic=True)


def test_empty_batch():
    check_empty_batch(mhc)


def test_capability_rejects_unsupported_hc():
    predicate = mhc.MHC_CAPABILITY.predicate
    assert predicate(*inputs(2, 4, 8), hc=4) is None
    assert "hc=3" in predicate(torch.zeros(2, 6), torch.zeros(6, 15), hc=3)


def test_calls_of_one_shape_that_differ_elsewhere():
    """Plans are keyed on all a launch depends on: calls of one shape with another row stride, dtype, tmax or
    set of upstream gradients each get their own."""
    run(9, 4, 8, 3)
    run(9, 4, 8, 3, x_row_stride=40)
    run(9, 4, 8, 3, phi_dtype=torch.float64)
    run(9, 4, 8, 2)
    run(9, 4, 8, 3, present=(False, True, True))


@pytest.mark.parametrize("views", [False, True], ids=["fresh", "views"])
def test_user_level_outputs_take_in_place_changes(views, isolated_table):
    """The composed op's outputs are no views made inside its autograd Function (autograd forbids changing
    those in place), also when a backend's forward returns views (a backend registered here: Triton's kernels,
    its forward's outputs made views)."""
    from liger_dispatch import dispatch, register_backend
    from liger_dispatch.backends.reference.formulas import mhc_coeffs

    @functools.wraps(mhc.mhc_coeff_fwd)
    def fwd(*args, **kwargs):
        pre, post, res, mix, rstd = mhc.mhc_coeff_fwd(*args, **kwargs)
        return (pre.t().contiguous().t(), post[:, :], res, mix, rstd) if views else (pre, post, res, mix, rstd)

    register_backend("mhc_coeff_fwd", backend="views", capability=mhc.MHC_CAPABILITY)(fwd)
    register_backend("mhc_coeff_bwd", backend="views", capability=mhc.MHC_CAPABILITY)(mhc.mhc_coeff_bwd)
    hc, tmax = 4, 3
    x, phi, b, *alphas = inputs(6, hc, 8)
    leaves = [t.reshape(2, 3, hc, 8) if t is x else t for t in (x, phi, b, *alphas)]
    got = [t.clone().requires_grad_() for t in leaves]
    want = [t.double().requires_grad_() for t in leaves]
    weights = [u.reshape(2, 3, *u.shape[1:]) for u in upstream(6, hc)]
    outs = dispatch.op("mhc_coeffs", backend="views")(*got, tmax=tmax, **OPTIONS)
    for h in outs:
        h.mul_(2.0)
    sum((h * u).sum() for h, u in zip(outs, weights)).backward()
    expected = mhc_coeffs(*want, tmax=tmax, **OPTIONS)
    sum(2.0 * (h * u).sum() for h, u in zip(expected, weights)).backward()
    for h, w in zip(outs, expected):
        torch.testing.assert_close(h.double(), 2.0 * w.detach(), rtol=1e-4, atol=1e-4)
    for g, w in zip(got, want):
        assert rel_err(g.grad, w.grad) <= REL_TOL[torch.float32]


def test_plans_are_reused():
    """A call's grids, constexprs and buffer shapes are computed once per signature."""
    mhc._plans.clear()
    args = inputs(6, 4, 8)
    outs = mhc.mhc_coeff_fwd(*args, hc=4, tmax=3)
    mhc.mhc_coeff_bwd(*args, outs[3], outs[4], *upstream(6, 4), hc=4, tmax=3)
    plans = list(mhc._plans.values())
    outs = mhc.mhc_coeff_fwd(*args, hc=4, tmax=3)
    mhc.mhc_coeff_bwd(*args, outs[3], outs[4], *upstream(6, 4), hc=4, tmax=3)
    assert len(plans) == 2 and list(mhc._plans.values()) == plans


def test_direct_launch():
    """Launching the kept compiled kernel directly is what Triton's own launch would do. Compiled Triton is
    needed for that, so a child process without the interpreter runs _check_direct_launch (below) against a
    stand-in driver."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout + child.stderr


def _check_direct_launch():
    """Triton's driver is replaced by a stand-in: compiling makes a kernel object that records its launches.
    Each case is called three times: the first goes through Triton's launch and keeps the compiled kernels,
    the second launches them directly, the third is made to go through Triton's launch again. The second and
    third must launch the same kernels (same specialization) with the same launcher arguments."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 1234

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    launches = []

    class Compiled:
        function, packed_metadata = object(), object()

        def launch_metadata(self, *args):
            return None

        def run(self, *args):
            launches.append((self, args))

    def compile_stand_in(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = self.device_caches[device][0][key] = Compiled()
        return kernel

    driver.set_active(Driver())
    JITFunction._do_compile = compile_stand_in
    assert _support._FAST_LAUNCH

    def layout(a):
        if isinstance(a, torch.Tensor):
            return a.dtype, a.shape, a.stride(), a.data_ptr() % 16
        return a

    def same_argument(direct, through_triton):
        """A direct launch passes a tensor as its address (an int): the alignment Triton specialized on must hold."""
        if isinstance(through_triton, torch.Tensor) and type(direct) is int:
            return direct % 16 == through_triton.data_ptr() % 16
        return layout(direct) == layout(through_triton)

    def call(args, grads, hc, fwd_config, bwd_config):
        launches.clear()
        with launch(fwd_config, bwd_config):
            outs = mhc.mhc_coeff_fwd(*args, hc=hc, tmax=3, **OPTIONS)
            mhc.mhc_coeff_bwd(*args, outs[3], outs[4], *grads, hc=hc, tmax=3, **OPTIONS)
        return [(kernel, a[:6], list(a[9:]), a[6:9]) for kernel, a in launches]

    misaligned = torch.zeros(2)[1]  # 4 bytes into its buffer
    cases = [  # (inputs, upstream gradients present, fwd config, bwd config, arguments changed after the first call)
        (dict(m=5, hc=4, c=8), (True, True, True), None, None, {}),
        (dict(m=37, hc=2, c=16), (True, True, True), SPLIT_FWD, GROUPED_BWD, {}),
        (dict(m=9, hc=4, c=8, dtype=torch.bfloat16, x_row_stride=40), (False, True, False), None, None, {}),
        (dict(m=9, hc=4, c=8, dtype=torch.bfloat16, phi_dtype=torch.float32), (False,) * 3, None, None, {}),
        # the kept kernels assume an aligned fp32 alpha_pre / b: not these
        (dict(m=6, hc=8, c=2), (True, True, True), None, None, {3: misaligned}),
        (dict(m=6, hc=8, c=2), (True, True, True), None, None, {2: torch.zeros(80, dtype=torch.float64)}),
    ]
    for shape, present, fwd_config, bwd_config, changed in cases:
        args = inputs(**shape)
        grads = upstream(shape["m"], shape["hc"], present)
        call(args, grads, shape["hc"], fwd_config, bwd_config)
        args = tuple(changed.get(i, a) for i, a in enumerate(args))
        direct = call(args, grads, shape["hc"], fwd_config, bwd_config)
        _support._FAST_LAUNCH = False
        through_triton = call(args, grads, shape["hc"], fwd_config, bwd_config)
        _support._FAST_LAUNCH = True
        assert len(direct) == len(through_triton) == (5 if fwd_config else 4), shape
        for d, t in zip(direct, through_triton):
            assert d[:2] == t[:2], (shape, d, t)  # the same compiled kernel (specialization), grid and stream
            assert len(d[2]) == len(t[2]) and all(map(same_argument, d[2], t[2])), (shape, d, t)
            assert (d[3] == (None, None, None)) == (not changed), d[3]  # direct: no launch hooks
            if changed:  # through Triton's launch both times: tensors
                assert [layout(v) for v in d[2]] == [layout(v) for v in t[2]], (shape, d, t)

    # The label check and the gradient scale (backends/triton/support.py) launch the same way.
    from liger_dispatch.backends.triton import support

    target, grad, grad_loss = torch.arange(5), torch.ones(10), torch.ones(())
    for launch_once in (lambda: support.launch_check(target, 7, -100), lambda: support.launch_scale(grad, grad_loss)):
        launches.clear()
        launch_once()  # through Triton's launch: compiles and keeps the kernel
        launch_once()  # direct
        _support._FAST_LAUNCH = False
        launch_once()
        _support._FAST_LAUNCH = True
        (_, direct), (_, through_triton) = launches[1:]
        assert launches[1][0] is launches[2][0] and direct[:6] == through_triton[:6], launches
        assert direct[6:9] == (None, None, None) and all(map(same_argument, direct[9:], through_triton[9:])), launches


# ---------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
def test_gpu_direct_launch_matches_triton_launch(monkeypatch):
    """The kept compiled kernels launched directly give what Triton's own launch gives, bit for bit."""
    args = inputs(4 * 512, 4, 1024, torch.bfloat16)
    grads = upstream(4 * 512, 4)

    def fwd_bwd():
        outs = mhc.mhc_coeff_fwd(*args, hc=4, tmax=20, **OPTIONS)
        return (*outs, *mhc.mhc_coeff_bwd(*args, outs[3], outs[4], *grads, hc=4, tmax=20, **OPTIONS))

    fwd_bwd()  # compiles and keeps the kernels
    direct = fwd_bwd()
    monkeypatch.setattr(_support, "_FAST_LAUNCH", False)
    for name, a, b in zip(("h_pre", "h_post", "h_res", "mix", "rstd", *GRAD_NAMES), direct, fwd_bwd()):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("t,c", [(512, 1024), (2048, 4096)], ids=["T512-C1024", "T2048-C4096"])
def test_gpu_real_shapes_bf16(t, c):
    run(4 * t, 4, c, 20, torch.bfloat16, deterministic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_other_dtypes(dtype):
    run(4 * 512, 4, 1024, 20, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("hc", [2, 8])
def test_gpu_other_streams(hc):
    run(4 * 512, hc, 1024, 20, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 100, 300])
def test_gpu_small_batches_split_k(m):
    """Few rows: the forward splits K (two launches)."""
    run(m, 4, 4096, 20, torch.bfloat16)


if __name__ == "__main__":
    _check_direct_launch()
