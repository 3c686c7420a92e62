"""The selector: order of preference sources, env vars, lists, fallback warnings, strict mode, unknown
names, third-party backends, discovery failures, concurrency, explain."""

import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import liger_dispatch as ld
from liger_dispatch import dispatch
from liger_dispatch.core import selection
from liger_dispatch.errors import BackendUnavailableError, FallbackWarning, UnknownBackendError, UnknownOpError
from liger_dispatch.core.table import OpSpec

CPU = ld.Capability(devices=("cpu",))
CUDA_ONLY = ld.Capability(devices=("cuda",), min_cc=(9, 0))


@pytest.fixture
def toy(isolated_table):
    """An op `toy(x)` served by alpha (priority 5), beta (priority 7), a CUDA-only gamma and the reference."""
    isolated_table.declare_op(OpSpec("toy(Tensor x, float scale=1.0) -> Tensor", "kernel", lambda a: None,
                                     aliases=("toy_alias",)))
    for name, priority, cap in (("alpha", 5, CPU), ("beta", 7, CPU), ("gamma", 1, CUDA_ONLY), ("reference", 100, CPU)):
        ld.register_backend("toy", backend=name, priority=priority, capability=cap)(_toy(name))
    return dispatch.op("toy")


def _toy(name):
    def toy(x, scale=1.0):
        return name, x * scale

    return toy


def served(handle, *args, **kwargs):
    return handle(torch.ones(2), *args, **kwargs)[0]


def test_auto_picks_best_priority_among_capable(toy):
    assert served(toy) == "alpha"  # gamma has the best priority but needs CUDA; no warning in auto mode


def test_preference_sources_in_order(toy, monkeypatch):
    monkeypatch.setenv("LIGER_BACKEND", "beta")
    assert served(toy) == "beta"
    monkeypatch.setenv("LIGER_BACKEND_TOY", "reference")
    assert served(toy) == "reference"  # per-op beats global
    with ld.use_backend("alpha"):
        assert served(toy) == "alpha"  # use_backend beats env
        assert served(dispatch.op("toy", backend="beta")) == "beta"  # the handle's pin beats everything
    assert served(toy) == "reference"


def test_use_backend_is_thread_local(toy):
    seen = {}
    with ld.use_backend("beta"):
        thread = threading.Thread(target=lambda: seen.setdefault("other", served(toy)))
        thread.start()
        thread.join()
        assert served(toy) == "beta"
    assert seen["other"] == "alpha"


def test_preference_list_falls_through_with_one_warning_per_reason(toy, monkeypatch):
    monkeypatch.setenv("LIGER_BACKEND", "gamma,beta")
    with pytest.warns(FallbackWarning, match=r"gamma.*needs a CUDA device.*falling back to 'beta'"):
        assert served(toy) == "beta"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert served(toy) == "beta"  # same reason: no second warning


def test_strict_turns_fallback_into_error(toy, monkeypatch):
    monkeypatch.setenv("LIGER_BACKEND", "gamma")
    monkeypatch.setenv("LIGER_STRICT", "1")
    with pytest.raises(BackendUnavailableError, match="gamma"):
        toy(torch.ones(2))
    with pytest.raises(BackendUnavailableError):  # every call, not just the first
        toy(torch.ones(2))


def test_unknown_backend_name_is_an_error_listing_the_names(toy, monkeypatch):
    monkeypatch.setenv("LIGER_BACKEND", "trition")
    with pytest.raises(UnknownBackendError, match=r"trition.*registered backends: .*triton"):
        toy(torch.ones(2))
    monkeypatch.delenv("LIGER_BACKEND")
    with pytest.raises(UnknownBackendError, match="nope"):
        dispatch.op("toy", backend="nope")(torch.ones(2))


def test_unknown_op_and_alias(toy):
    assert dispatch.op("toy_alias").name == "toy"
    with pytest.raises(UnknownOpError, match="unknown op 'nope'"):
        dispatch.op("nope")


def test_predicate_rejection_falls_to_next_backend(isolated_table, monkeypatch):
    isolated_table.declare_op(OpSpec("sized(Tensor x) -> Tensor", "kernel", lambda a: None))
    small_only = ld.Capability(devices=("cpu",), predicate=lambda x: "too large" if x.numel() > 4 else None)
    ld.register_backend("sized", backend="alpha", priority=1, capability=small_only)(lambda x: "alpha")
    ld.register_backend("sized", backend="reference", priority=100, capability=CPU)(lambda x: "reference")
    handle = dispatch.op("sized")
    assert handle(torch.ones(2)) == "alpha"
    with pytest.warns(FallbackWarning, match=r"no backend other than the reference can serve this call \[alpha: too large\]"):
        assert handle(torch.ones(8)) == "reference"  # auto mode falls through, loudly; explain tells why
    assert "too large" in str(handle.explain(torch.ones(8)))
    monkeypatch.setenv("LIGER_BACKEND", "alpha")
    selection.reset()  # the (op, backend, reason) above was already warned about once
    with pytest.warns(FallbackWarning, match="too large"):
        assert handle(torch.ones(8)) == "reference"


def test_dtype_capability_checks_every_float_tensor(isolated_table):
    isolated_table.declare_op(OpSpec("pair(Tensor a, Tensor b) -> Tensor", "kernel", lambda a: None))
    ld.register_backend("pair", backend="alpha", priority=1,
                        capability=ld.Capability(devices=("cpu",), dtypes=(torch.float32,)))(lambda a, b: "alpha")
    ld.register_backend("pair", backend="reference", priority=100, capability=CPU)(lambda a, b: "reference")
    handle = dispatch.op("pair")
    assert handle(torch.ones(2), torch.ones(2, dtype=torch.long)) == "alpha"  # integer tensors are not checked
    with pytest.warns(FallbackWarning, match="does not support float16"):
        assert handle(torch.ones(2), torch.ones(2, dtype=torch.float16)) == "reference"


def test_third_party_backend_by_decorator_serves_the_composed_user_op(isolated_table, monkeypatch):
    from liger_dispatch.backends.reference.jsd import jsd_loss_and_grad

    calls = []

    @ld.register_backend("jsd_loss_and_grad", backend="mine", priority=5, capability=ld.Capability(devices=("cpu",)))
    def my_jsd(student_logits, teacher_logits, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0,
               grad_scale=None):
        calls.append(student_logits.shape)
        return jsd_loss_and_grad(student_logits, teacher_logits, labels, beta=beta, ignore_index=ignore_index,
                                 temperature=temperature, grad_scale=grad_scale)

    monkeypatch.setenv("LIGER_BACKEND", "mine")
    x, w, xt, wt = torch.randn(6, 8), torch.randn(11, 8, requires_grad=True), torch.randn(6, 8), torch.randn(11, 8)
    handle = dispatch.op("fused_linear_jsd")
    assert handle.select(x, w, xt, wt).backend == "mine"
    handle(x, w, xt, wt).backward()
    assert calls and w.grad is not None
    assert "mine" in ld.registered_backends("fused_linear_jsd")


def test_composition_requires_its_parts_to_agree(isolated_table):
    """mhc_coeffs is served under mhc_coeff_fwd's capability and priority: mhc_coeff_bwd must register the same."""
    from liger_dispatch.backends.reference import mhc

    cap = ld.Capability(devices=("cpu",))
    ld.register_backend("mhc_coeff_fwd", backend="split", priority=5, capability=cap)(mhc.mhc_coeff_fwd)
    ld.register_backend("mhc_coeff_bwd", backend="split", priority=6, capability=cap)(mhc.mhc_coeff_bwd)
    with pytest.raises(ValueError, match="different capabilities or priorities"):
        isolated_table.candidates("mhc_coeffs")


def test_discovery_failure_is_recorded_and_does_not_break_others(isolated_table):
    ld.declare_op_locations("ce_loss_and_grad", {"broken": "liger_dispatch_no_such_module.ce"})
    assert "broken" in ld.registered_backends("flce")
    status = dispatch.backend_status("flce", "cpu", torch.float32)
    assert "failed to import" in status["broken"] and "liger_dispatch_no_such_module" in status["broken"]
    assert status["reference"] is None


def lazy_backend(table, tmp_path, monkeypatch, op, backend, prologue=""):
    """Declares `op` and a backend module <backend>_backend_mod (imported on first use) whose impl returns its name."""
    (tmp_path / f"{backend}_backend_mod.py").write_text(
        f"import liger_dispatch as ld\n{prologue}"
        f"@ld.register_backend('{op}', backend='{backend}', priority=1, capability=ld.Capability(devices=('cpu',)))\n"
        f"def impl(x):\n    return '{backend}'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table.declare_op(OpSpec(f"{op}(Tensor x) -> Tensor", "kernel", lambda a: None))
    ld.declare_op_locations(op, {backend: f"{backend}_backend_mod"})


def test_concurrent_first_use_imports_once(isolated_table, tmp_path, monkeypatch):
    lazy_backend(isolated_table, tmp_path, monkeypatch, "slow_op", "slow",
                 prologue="import time\nIMPORTS = globals().get('IMPORTS', 0) + 1\ntime.sleep(0.3)\n")
    results, errors = [], []

    def call():
        try:
            results.append(dispatch.op("slow_op")(torch.ones(1)))
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == ["slow"] * 8
    assert sys.modules["slow_backend_mod"].IMPORTS == 1


def test_explain_names_the_selected_backend_and_why_not_the_others(toy):
    text = str(toy.explain(torch.ones(2)))
    assert "alpha [whole-op]: SELECTED" in text
    assert "gamma" in text and "needs a CUDA device" in text
    assert "beta" in text and "not chosen" in text


def test_cutedsl_on_cpu_falls_back_with_a_warning_and_raises_when_strict(monkeypatch):
    x, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    monkeypatch.setenv("LIGER_BACKEND", "cutedsl")
    with pytest.warns(FallbackWarning, match=r"cutedsl.*\[cutedsl: .+\]; falling back to 'reference'"):
        loss = dispatch.op("flce")(x, w, y)
    assert torch.isfinite(loss)
    monkeypatch.setenv("LIGER_STRICT", "1")
    with pytest.raises(BackendUnavailableError, match="cutedsl"):
        dispatch.op("flce")(x, w, y)


def test_available_and_registered_backends():
    assert ld.registered_backends("flce")[:1] == ["reference"]
    assert set(ld.registered_backends("fused_linear_cross_entropy")) >= {"reference", "triton", "cutedsl", "helion"}
    usable = ld.available_backends("flce", device="cpu", dtype=torch.float32)
    assert usable[-1] == "reference" and "cutedsl" not in usable


def test_kernel_predicate_judges_the_composed_user_op(isolated_table, monkeypatch):
    """A kernel-level shape limit applies to the user-level op composed of it (through the op's probe)."""
    from liger_dispatch.backends.reference.ce import ce_loss_and_grad

    narrow = ld.Capability(devices=("cpu",), predicate=lambda logits, target, **kw:
                           f"V = {logits.shape[1]} > 16" if logits.shape[1] > 16 else None)
    ld.register_backend("ce_loss_and_grad", backend="narrow", priority=1, capability=narrow)(ce_loss_and_grad)
    x, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    handle = dispatch.op("flce")
    assert handle.select(x, torch.randn(10, 8), y).backend == "narrow"
    assert handle.select(x, torch.randn(40, 8), y).backend != "narrow"
    assert "V = 40 > 16" in str(handle.explain(x, torch.randn(40, 8), y))


def test_reference_is_no_fallback_when_no_other_backend_accepts_the_device_type(isolated_table, monkeypatch):
    """CPU tensors, and the only other backend runs on CUDA alone: auto picks the reference without a warning, and
    LIGER_STRICT does not object; a backend that accepts CPU tensors but not this call still makes it a fallback."""
    isolated_table.declare_op(OpSpec("gpu_only(Tensor x) -> Tensor", "kernel", lambda a: None))
    ld.register_backend("gpu_only", backend="gamma", priority=1, capability=CUDA_ONLY)(lambda x: "gamma")
    ld.register_backend("gpu_only", backend="reference", priority=100, capability=CPU)(lambda x: "reference")
    monkeypatch.setenv("LIGER_STRICT", "true")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.op("gpu_only")(torch.ones(2)) == "reference"
    assert "fallback" not in str(dispatch.op("gpu_only").explain(torch.ones(2)))
    fp32_only = ld.Capability(devices=("cpu", "cuda"), dtypes=(torch.float32,))
    ld.register_backend("gpu_only", backend="beta", priority=2, capability=fp32_only)(lambda x: "beta")
    with pytest.raises(BackendUnavailableError, match=r"no backend other than the reference.*beta: does not support"):
        dispatch.op("gpu_only")(torch.ones(2, dtype=torch.float16))
    monkeypatch.delenv("LIGER_STRICT")
    with pytest.warns(FallbackWarning) as record:
        dispatch.op("gpu_only")(torch.ones(2, dtype=torch.float16))
    assert "gamma" not in str(record[0].message)  # only the backends that could have served are named


def test_fallback_warnings_point_at_the_callers_line(monkeypatch):
    """From an nn module (under torch.nn.Module.__call__) and from a handle: the warning names this file and line."""
    monkeypatch.setenv("LIGER_BACKEND", "cutedsl")
    x, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    for call in (ld.nn.FusedLinearCrossEntropyLoss(), dispatch.op("flce")):
        selection.reset()
        with pytest.warns(FallbackWarning) as record:
            line = sys._getframe().f_lineno + 1
            call(x, w, y)
        assert (record[0].filename, record[0].lineno) == (__file__, line)


def test_a_lazy_import_leaves_its_resolution_memoized(isolated_table, tmp_path, monkeypatch):
    """The first call imports a backend module, which registers (the op's version moves during the resolution): the
    plan is stored under the version the next call looks it up with, so it is resolved once."""
    lazy_backend(isolated_table, tmp_path, monkeypatch, "lazy_op", "lazy")
    resolved = []
    resolve = selection._static
    monkeypatch.setattr(selection, "_static", lambda *a: resolved.append(a) or resolve(*a))
    handle = dispatch.op("lazy_op")
    assert [handle(torch.ones(1)) for _ in range(3)] == ["lazy"] * 3
    assert len(resolved) == 1


def test_available_backends_defaults_to_this_machine_and_says_why_cuda_is_empty():
    here = ld.available_backends("flce")
    assert here and here[-1] == "reference"
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="this machine has no CUDA device"):
            assert ld.available_backends("flce", device="cuda") == []


def test_version_and_dependencies():
    """liger_dispatch.__version__ is the installed distribution's; numpy is a dependency (without it torch warns
    "Failed to initialize NumPy" on every run of the README's demo install)."""
    from importlib import metadata

    tomllib = pytest.importorskip("tomllib")
    assert ld.__version__ == metadata.version("liger-dispatch")
    with open(Path(__file__).parents[1] / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert any(d.startswith("numpy") for d in dependencies)
