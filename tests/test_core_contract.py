"""The core's contract where it used to be fragile: what selection does with a raising predicate, a malformed tuned
entry or a backend module that fails at import in any way; registrations that are checked where they are made;
the CLI summary under a backend pin; concurrent first calls in a fresh process."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import dispatch
from liger_dispatch.core.table import OpSpec
from liger_dispatch.errors import FallbackWarning, RegistrationError, UnknownBackendError
from liger_dispatch.tools import cli
from liger_dispatch.tuning import tuned

from test_selection import lazy_backend
from test_tuned import write_table

CPU = ld.Capability(devices=("cpu",))


def _declare(table, name):
    table.declare_op(OpSpec(f"{name}(Tensor x) -> Tensor", "kernel", lambda a: None, fake=lambda a: a.x))


def test_a_raising_predicate_rejects_its_backend_with_the_exception_as_reason(isolated_table):
    _declare(isolated_table, "pred_op")

    def broken(x):
        raise ZeroDivisionError("the predicate's own bug")

    ld.register_backend("pred_op", backend="shaky", priority=1,
                        capability=ld.Capability(devices=("cpu",), predicate=broken))(lambda x: x + 1)
    ld.register_backend("pred_op", backend="steady", priority=2, capability=CPU)(lambda x: x + 2)
    x = torch.zeros(2) + 5
    assert torch.equal(dispatch.op("pred_op")(x), x + 2)  # the other backends serve
    text = str(dispatch.op("pred_op").explain(x))
    assert "shaky" in text and "its capability predicate raised ZeroDivisionError: the predicate's own bug" in text
    with pytest.warns(FallbackWarning, match="shaky.*ZeroDivisionError"):
        assert torch.equal(dispatch.op("pred_op", backend="shaky,steady")(x), x + 2)


def test_a_malformed_tuned_entry_is_skipped_with_one_warning_naming_it(tmp_path, monkeypatch):
    path = write_table(tmp_path / "table.json", [{"op": "flce", "dtype": "float32", "n": 8, "bucket": "v=128",
                                                  "ms": {"reference": 1.0}}])
    data = json.loads(path.read_text())
    data["entries"].append({"op": "flce", "ms": {"reference": 1.0}})  # no dtype, no n
    path.write_text(json.dumps(data))
    monkeypatch.setenv("LIGER_TUNED_TABLE", str(path))
    tuned.reset()
    x, w, y = torch.randn(8, 4), torch.randn(100, 4), torch.randint(0, 100, (8,))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert dispatch.op("flce")(x, w, y).isfinite()
        dispatch.op("flce")(x, w, y)
    malformed = [r for r in record if "malformed" in str(r.message)]
    assert len(malformed) == 1 and str(path) in str(malformed[0].message) and "entry 1" in str(malformed[0].message)


@pytest.mark.parametrize("failure", ["raise SystemExit(3)", "raise ImportError('no such kernel library')",
                                     "raise RuntimeError('broken at import')"])
def test_a_backend_module_failing_at_import_is_unavailable_with_its_reason(isolated_table, tmp_path, monkeypatch,
                                                                          failure):
    lazy_backend(isolated_table, tmp_path, monkeypatch, "import_op", "brittle", prologue=failure + "\n")
    ld.register_backend("import_op", backend="reference", capability=CPU)(lambda x: "reference")
    assert dispatch.op("import_op")(torch.ones(1)) == "reference"
    reason = ld.dispatch.backend_status("import_op", "cpu", torch.float32)["brittle"]
    assert "brittle_backend_mod failed to import" in reason and failure.split("(")[0].split()[-1] in reason


def test_a_second_registration_of_one_backend_is_an_error_unless_replace(isolated_table):
    _declare(isolated_table, "dup_op")
    ld.register_backend("dup_op", backend="mine", capability=CPU)(lambda x: x + 1)
    with pytest.raises(RegistrationError, match="'mine' already registered .* dup_op; pass replace=True"):
        ld.register_backend("dup_op", backend="mine", capability=CPU)(lambda x: x + 2)
    ld.register_backend("dup_op", backend="mine", capability=CPU, replace=True)(lambda x: x + 3)
    assert torch.equal(dispatch.op("dup_op", backend="mine")(torch.zeros(1)), torch.full((1,), 3.0))


@pytest.mark.parametrize("kwargs,message", [
    (dict(devices=("gpu",)), "'gpu' is not a device type"),
    (dict(dtypes=("bf16",)), "'bf16' is not a torch.dtype"),
    (dict(devices="cuda"), "sequences of names, not one string"),
    (dict(min_cc=(9,)), "not a \\(major, minor\\) pair"),
])
def test_capability_rejects_what_it_does_not_know(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ld.Capability(**kwargs)


def test_a_handle_pinned_to_an_unknown_backend_raises_when_it_is_made():
    with pytest.raises(UnknownBackendError, match="unknown backend 'nonexistent'.*registered backends: reference"):
        dispatch.op("flce", backend="nonexistent")


def test_the_cli_summary_honours_the_backend_pin(monkeypatch, capsys):
    monkeypatch.setenv("LIGER_BACKEND", "cutedsl")
    assert cli.main(["--device", "cpu", "--dtype", "fp32"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "flce: LIGER_BACKEND = cutedsl: falls back to reference (cutedsl: needs a CUDA device" in out
    assert "auto picks" not in out
    monkeypatch.setenv("LIGER_STRICT", "1")
    assert cli.main(["--device", "cpu", "--dtype", "fp32"]) == 0
    assert "flce: LIGER_BACKEND = cutedsl: calls raise" in " ".join(capsys.readouterr().out.split())


def test_the_cli_with_an_unknown_backend_name_is_an_error(monkeypatch, capsys):
    monkeypatch.setenv("LIGER_BACKEND", "nonexistent")
    assert cli.main(["--device", "cpu", "--dtype", "fp32"]) != 0
    assert "unknown backend 'nonexistent' (from LIGER_BACKEND)" in capsys.readouterr().err


def test_concurrent_first_calls_in_a_fresh_process_raise_nothing():
    """7 threads make first calls (flce, JSD, KL: a new shape each call) while an eighth imports every backend
    module (registered_backends; helion imports torch.distributed.tensor, which the calls' DTensor check reads half
    made): no error, and the reference serves every CPU call. Before the fix every calling thread raised
    "partially initialized module 'torch.distributed.tensor' has no attribute 'DTensor'"."""
    script = textwrap.dedent("""
        import threading, torch
        import liger_dispatch as ld
        from liger_dispatch import dispatch
        done = threading.Event()
        def importer():
            try:
                for op in ("flce", "mhc_coeffs", "fused_linear_jsd", "fused_linear_kl_div"):
                    ld.registered_backends(op)  # imports every backend module (helion imports torch.distributed.tensor)
                    ld.available_backends(op)
            finally:
                done.set()
        errors, chosen = [], set()
        barrier = threading.Barrier(8)
        def caller(i):
            barrier.wait()
            n = 1
            try:
                while not done.is_set() and n < 400:  # new shapes: every call a first call of its signature
                    n += 1
                    x, w, y = torch.randn(n, 8), torch.randn(32, 8, requires_grad=True), torch.randint(0, 32, (n,))
                    [lambda: dispatch.op("flce")(x, w, y).backward(),
                     lambda: dispatch.op("fused_linear_jsd")(x, w, x, w.detach()),
                     lambda: dispatch.op("fused_linear_kl_div")(x, w, torch.softmax(torch.randn(n, 32), -1))][i % 3]()
                chosen.add(dispatch.op("flce").select(x, w, y).backend)
            except BaseException as exc:
                errors.append(repr(exc))
        def run_importer():
            barrier.wait()
            importer()
        threads = [threading.Thread(target=caller, args=(i,)) for i in range(7)] + [threading.Thread(target=run_importer)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print("ERRORS", len(errors), errors[:3])
        print("CHOSEN", sorted(chosen))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ERRORS 0 []" in out.stdout, out.stdout
    assert "CHOSEN ['reference']" in out.stdout, out.stdout


DOUBLE_BACKWARD = [("flce", "flce_args", {}), ("flce", "flce_args", {"reduction": "none"}),
                   ("fused_linear_jsd", "jsd_args", {}), ("fused_linear_kl_div", "kl_args", {}),
                   ("mhc_coeffs", "mhc_args", {})]


def _first_input_and_loss(op, make, kwargs, compiled):
    import test_checks

    args = getattr(test_checks, make)()
    first = next(iter(args))
    args[first] = args[first].requires_grad_()
    handle = dispatch.op(op, backend="reference")
    fn = torch.compile(handle, fullgraph=True, backend="aot_eager") if compiled else handle
    torch._dynamo.reset()
    out = fn(*args.values(), **kwargs)
    outputs = out if isinstance(out, tuple) else (out,)
    return args[first], sum(o.float().sum() for o in outputs)


@pytest.mark.parametrize("op,make,kwargs", DOUBLE_BACKWARD, ids=[f"{o}{'-' + ''.join(k) if k else ''}"
                                                                 for o, _, k in DOUBLE_BACKWARD])
def test_a_double_backward_is_an_error_naming_the_op_in_eager_code(op, make, kwargs):
    x, loss = _first_input_and_loss(op, make, kwargs, compiled=False)
    with pytest.raises(ld.errors.DoubleBackwardError, match=f"{op} computes its gradient in the forward pass"):
        torch.autograd.grad(loss, x, create_graph=True)
    x, loss = _first_input_and_loss(op, make, kwargs, compiled=False)
    (grad,) = torch.autograd.grad(loss, x)  # once is fine
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("op,make,kwargs", DOUBLE_BACKWARD, ids=[f"{o}{'-' + ''.join(k) if k else ''}"
                                                                 for o, _, k in DOUBLE_BACKWARD])
def test_a_double_backward_is_an_error_in_compiled_code(op, make, kwargs):
    """Compiled, the backward is AOTAutograd's: as with torch's once_differentiable, the gradient made with
    create_graph=True raises when it is differentiated (torch's message: the compiled graph no longer names the op)."""
    x, loss = _first_input_and_loss(op, make, kwargs, compiled=True)
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        grad.square().sum().backward()


def _ce_returning(wrong):
    """The reference's ce_loss_and_grad with its per-row loss replaced by `wrong(loss)`."""
    from liger_dispatch.backends.reference.ce import ce_loss_and_grad

    def kernel(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
               lse_square_scale=0.0, ce_weight=None, row_stats=None):
        return wrong(ce_loss_and_grad(logits, target, grad_scale=grad_scale, ignore_index=ignore_index,
                                      label_smoothing=label_smoothing, softcap=softcap,
                                      lse_square_scale=lse_square_scale, ce_weight=ce_weight, row_stats=row_stats))

    return kernel


@pytest.mark.parametrize("wrong,message", [
    (lambda loss: None, "returned NoneType where the op returns a float32 tensor of shape \\[6\\]"),
    (lambda loss: torch.cat([loss, loss[:1]]), "returned a float32 tensor of shape \\[7\\] on cpu where the op "
                                               "returns a float32 tensor of shape \\[6\\]"),
    (lambda loss: loss.view(2, 3), "returned a float32 tensor of shape \\[2, 3\\] on cpu where"),
    (lambda loss: loss.double(), "returned a float64 tensor"),
], ids=["None", "one row too many", "wrong shape", "wrong dtype"])
def test_what_a_backend_returns_is_checked_against_the_fake(isolated_table, wrong, message):
    ld.register_backend("ce_loss_and_grad", backend="wrong", priority=1, capability=CPU)(_ce_returning(wrong))
    x, w, y = torch.randn(6, 8), torch.randn(32, 8, requires_grad=True), torch.randint(0, 32, (6,))
    for handle in (dispatch.op("flce", backend="wrong"), dispatch.op("ce_loss_and_grad", backend="wrong")):
        args = (x, w, y) if handle.name == "flce" else (x @ w.detach().t(), y)
        with pytest.raises(ld.BackendError, match=f"wrong's implementation of ce_loss_and_grad {message}"):
            handle(*args)


def test_a_whole_op_implementation_returning_one_gradient_too_few_is_named(isolated_table):
    def flce(input, weight, target, bias=None, ce_weight=None, *, ignore_index=-100, reduction="mean",
             label_smoothing=0.0, softcap=None, lse_square_scale=0.0, return_z_loss=False,
             return_token_accuracy=False, accum_dtype=None, process_group=None, need_grads=(), row_weights=None,
             logits_grad=False):
        empty = torch.empty(0)
        return torch.zeros((), dtype=torch.float32), empty, empty, None, None  # the bias gradient is missing

    ld.register_backend("flce", backend="whole", priority=1, capability=CPU)(flce)
    x, w, y = torch.randn(6, 8), torch.randn(32, 8), torch.randint(0, 32, (6,))
    with pytest.raises(ld.BackendError, match="whole's implementation of flce returned 5 outputs, the op returns 6"):
        dispatch.op("flce", backend="whole")(x, w, y)


def test_the_signature_error_prints_the_whole_op_contract():
    with pytest.raises(ld.errors.SignatureError) as info:
        ld.register_backend("flce", backend="contract")(lambda input, weight, target: None)
    text = str(info.value)
    assert "parameter 'bias' is missing" in text
    assert "keyword-only after them, need_grads=[], row_weights=None" in text
    assert ("it returns (its 3 outputs, the loss first, a statistic the call does not ask for as an empty tensor; "
            "the gradient of input, the gradient of weight, the gradient of bias)") in text
