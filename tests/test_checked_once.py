"""The input checks run once per call signature (the plans of core/calls.py): a bad call raises every time, whatever passed before it, and a
call that differs from a passing one in one attribute (dtype, device, shape, strides, an option's value or type)
is checked again. The class-index check on the device: valid exactly where the host check is."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch.core import calls
from liger_dispatch.core.table import OpSpec
from liger_dispatch import dispatch
from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks
from liger_dispatch.backends.reference.support import check_class_indices
from liger_dispatch.backends.triton import support as triton_support

from test_checks import BAD, KERNEL_BAD, N, V, call, flce_args, kl_args, mhc_args


@pytest.mark.parametrize("op,args,kwargs,message", BAD, ids=[f"{b[0]}-{b[3][:24]}" for b in BAD])
def test_every_bad_input_raises_on_every_call(op, args, kwargs, message):
    for _ in range(3):
        with pytest.raises(InputError, match=message):
            call(op, args, **kwargs)


@pytest.mark.parametrize("op,args,kwargs,message", KERNEL_BAD, ids=[k[0] for k in KERNEL_BAD])
def test_every_bad_kernel_input_raises_on_every_call(op, args, kwargs, message):
    for _ in range(3):
        with pytest.raises(InputError, match=message):
            dispatch.op(op, backend="reference")(*args, **kwargs)


def _flce(**over):
    args = flce_args()
    args.update(over)
    return args


# (op, a call that passes, the same call with one attribute changed, the error that change must raise)
ONE_CHANGE = [
    ("flce", _flce(), {}, _flce(weight=torch.randn(V, 8, dtype=torch.float16)), {}, r"weight has dtype"),
    ("flce", _flce(), {}, _flce(weight=torch.randn(V, 8, device="meta")), {}, r"weight is on meta"),
    ("flce", _flce(), {}, _flce(target=torch.randint(0, V, (N + 1,))), {}, r"target: shape is \[6\], expected \[5\]"),
    ("flce", _flce(), {}, _flce(target=torch.randn(N)), {}, r"target must be an integer tensor"),
    ("flce", _flce(), dict(ignore_index=-100), _flce(), dict(ignore_index=-100.0), r"ignore_index must be an int"),
    ("flce", _flce(), dict(ignore_index=1), _flce(), dict(ignore_index=True), r"ignore_index must be an int"),
    ("flce", _flce(), dict(label_smoothing=0.5), _flce(), dict(label_smoothing=1.5), r"label_smoothing must be"),
    ("flce", _flce(), dict(reduction="sum"), _flce(), dict(reduction="avg"), r"reduction must be one of"),
    ("flce", _flce(), dict(softcap=None), _flce(), dict(softcap=0.0), r"softcap must be > 0"),
    ("flce", _flce(bias=torch.randn(V)), {}, _flce(bias=torch.randn(V + 1)), {}, r"bias: length"),
    ("fused_linear_kl_div", kl_args(), dict(reduction="sum"), kl_args(), dict(reduction="none"),
     r"reduction='none' is not supported"),
    ("mhc_coeffs", mhc_args(), {}, mhc_args(alpha_res=torch.ones(2)), {}, r"alpha_res must be a 0-d float32"),
    ("mhc_coeffs", mhc_args(), {}, mhc_args(b=torch.randn(24, dtype=torch.float64)), {}, r"b must be float32"),
    ("mhc_coeffs", mhc_args(), dict(tmax=3), mhc_args(), dict(tmax=0), r"tmax must be >= 1"),
]


@pytest.mark.parametrize("op,good,good_kwargs,bad,bad_kwargs,message", ONE_CHANGE,
                         ids=[f"{c[0]}-{c[5][:24]}" for c in ONE_CHANGE])
def test_one_changed_attribute_is_checked_again(op, good, good_kwargs, bad, bad_kwargs, message):
    for _ in range(2):
        call(op, good, **good_kwargs)
        with pytest.raises(InputError, match=message):
            call(op, bad, **bad_kwargs)


def test_only_the_strides_changed_is_checked_again():
    logits = torch.randn(N, V)
    target = torch.randint(0, V, (N,))
    handle = dispatch.op("ce_loss_and_grad", backend="reference")
    handle(logits.clone(), target)
    strided = torch.randn(V, N).t()  # the same shape, dtype and device; a column stride of N
    with pytest.raises(InputError, match=r"contiguous last dimension"):
        handle(strided, target)


def _counted_toy(table, name):
    """A declared kernel-level op `name`(x, *, scale) whose input check counts its calls, served by the reference."""
    checked = []

    def check(a):
        checked.append(a)
        if isinstance(a.scale, (int, float)) and not a.scale > 0:
            raise InputError(f"scale must be > 0, got {a.scale}")

    table.declare_op(OpSpec(f"{name}(Tensor x, *, float scale=1.0) -> Tensor", "kernel", check,
                            fake=lambda a: torch.empty_like(a.x)))
    ld.register_backend(name, backend="reference")(lambda x, *, scale=1.0: x.clone())
    return dispatch.op(name), checked


def test_a_passing_signature_is_checked_once_a_failing_one_every_time(isolated_table):
    run, checked = _counted_toy(isolated_table, "toy_checked")
    x = torch.randn(3)
    for _ in range(3):
        run(x)
    assert len(checked) == 1
    run(torch.randn(3))  # new data, same signature
    assert len(checked) == 1
    for changed in (torch.randn(4), torch.randn(3, dtype=torch.float64), torch.randn(6)[::2]):
        run(changed)
    assert len(checked) == 4
    for _ in range(2):
        with pytest.raises(InputError):
            run(x, scale=-1.0)
    assert len(checked) == 6
    run(x, scale=2)  # 2 == 2.0, but an int is another signature
    run(x, scale=2.0)
    assert len(checked) == 8


def test_unhashable_options_are_checked_every_time(isolated_table):
    run, checked = _counted_toy(isolated_table, "toy_unhashable")
    for _ in range(2):
        run(torch.randn(2), scale=[1.0])
    assert len(checked) == 2


def test_the_cache_is_bounded(isolated_table, monkeypatch):
    run, _ = _counted_toy(isolated_table, "toy_bounded")
    monkeypatch.setattr(calls, "LIMIT", 4)
    for n in range(10):
        run(torch.randn(n + 1))
    assert len(calls._plans) <= 4


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("ignore_index", [-100, -1, 0, 4, V - 1, V, V + 2])
def test_device_class_index_check_accepts_exactly_the_valid_labels(dtype, ignore_index):
    """The device expression (run here on CPU tensors, where _assert_async raises at once) against the rule."""
    for value in range(-102, V + 4):
        if dtype == torch.uint8 and value < 0:
            continue
        target = torch.tensor([0, value, V - 1], dtype=dtype)
        valid = value == ignore_index or 0 <= value < V
        if valid:
            check_class_indices(target, vocab=V, ignore_index=ignore_index)
        else:
            with pytest.raises(RuntimeError, match=rf"target holds a class index outside \[0, {V}\)"):
                check_class_indices(target, vocab=V, ignore_index=ignore_index)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("ignore_index", [-100, 0, V, V + 2])
def test_triton_class_index_check_accepts_exactly_the_valid_labels(dtype, ignore_index, monkeypatch):
    """The one-launch Triton check the GPU runs, in the interpreter on CPU tensors, against the rule (the
    interpreter ignores a kernel's debug flag, which compiles the assert in on the GPU: it is set here)."""
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError

    options = interpreter.interpreter_builder.options
    monkeypatch.setattr(interpreter.interpreter_builder, "options", dataclasses.replace(options, debug=True))
    for value in (-101, -100, -1, 0, 1, V - 1, V, V + 1, V + 2):
        if dtype == torch.uint8 and value < 0:
            continue
        target = torch.tensor([0, value, V - 1] * 700, dtype=dtype)  # more than one program's block
        if value == ignore_index or 0 <= value < V:
            triton_support.launch_check(target, V, ignore_index)
        else:
            with pytest.raises(InterpreterError, match=r"target holds a class index outside \[0, V\)"):
                triton_support.launch_check(target, V, ignore_index)


def test_triton_class_index_check_reads_a_strided_target_as_its_values(monkeypatch):
    """A column of a label matrix (a 1-D view of stride 3) whose neighbours are out of range: the check reads the
    column's values, not the memory after its first element (the GPU would stop on a false assert)."""
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    monkeypatch.setattr(interpreter.interpreter_builder, "options", dataclasses.replace(options, debug=True))
    labels = torch.full((700, 3), V + 5)
    labels[:, 0] = torch.randint(0, V, (700,))
    triton_support.check_class_indices(labels[:, 0], vocab=V, ignore_index=-100)


def test_host_class_index_check_names_the_value():
    with pytest.raises(InputError, match=rf"target holds {V}, outside"):
        checks.class_indices("target", torch.tensor([1, V]), V, -100)


@pytest.mark.gpu
def test_gpu_bad_label_stops_the_device_and_full_checks_name_it():
    """A label outside [0, V) on the GPU: a device-side assert (in a child process: it ends the CUDA context);
    with LIGER_CHECKS=full, the host check's InputError."""
    script = textwrap.dedent(f"""
        import torch
        from liger_dispatch import dispatch
        x, w = torch.randn({N}, 8, device="cuda"), torch.randn({V}, 8, device="cuda")
        target = torch.randint(0, {V}, ({N},), device="cuda")
        target[0] = -100
        dispatch.op("flce")(x, w, target)
        torch.cuda.synchronize()
        target[1] = {V}
        try:
            dispatch.op("flce")(x, w, target)
            torch.cuda.synchronize()
        except Exception as exc:
            print("RAISED", type(exc).__name__, exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "device-side assert" in done.stdout + done.stderr, done.stdout + done.stderr
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LIGER_CHECKS", "full")
        target = torch.randint(0, V, (N,), device="cuda")
        target[1] = V
        with pytest.raises(InputError, match=rf"target holds {V}"):
            dispatch.op("flce")(torch.randn(N, 8, device="cuda"), torch.randn(V, 8, device="cuda"), target)
