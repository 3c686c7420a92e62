"""Lazy discovery: a call imports only the backends that can serve its device type, outside the table's lock."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

DSLS = ("triton", "helion", "cutlass")


def run_fresh(code: str, cwd=None, timeout=120) -> str:
    """Runs `code` in a fresh interpreter without the interpreters' or liger-dispatch's variables; its stdout."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("LIGER_") and k not in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the subprocess did not finish in {timeout} s (a deadlock?)")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_call_served_by_the_reference_imports_no_other_backends_dsl():
    """Pinned to the reference, and (without a GPU) in auto mode, strict and with warnings as errors: no DSL is
    imported, and the reference serving CPU tensors is no fallback."""
    auto = "" if torch.cuda.is_available() else "dispatch.op('flce')(x, w, y); dispatch.op('mhc_coeffs', backend='reference')"
    out = run_fresh(f"""
        import os, sys, warnings
        os.environ["LIGER_STRICT"] = "1"
        warnings.simplefilter("error")
        import torch
        from liger_dispatch import dispatch
        x, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
        dispatch.op("flce", backend="reference")(x, w, y)
        dispatch.op("fused_linear_jsd", backend="reference")(x, w, x, w)
        {auto}
        print(sorted(m for m in {DSLS!r} if m in sys.modules))
        """)
    assert out.strip() == "[]"


def test_two_threads_discovering_at_once_do_not_deadlock(tmp_path):
    """Thread B imports a module that registers into the table (it sleeps first); thread A's discovery imports a
    backend module that imports the same module. Were A to hold the table's lock while importing, B would wait
    for the lock inside its import and A for B's import: a deadlock."""
    (tmp_path / "shared_mod.py").write_text(textwrap.dedent("""
        import time, liger_dispatch as ld
        time.sleep(0.5)
        @ld.register_backend("dl_op", backend="shared", priority=2, capability=ld.Capability(devices=("cpu",)))
        def shared(x):
            return "shared"
        """))
    (tmp_path / "backend_mod.py").write_text(textwrap.dedent("""
        import shared_mod, liger_dispatch as ld
        @ld.register_backend("dl_op", backend="mine", priority=1, capability=ld.Capability(devices=("cpu",)))
        def mine(x):
            return "mine"
        """))
    out = run_fresh("""
        import importlib, threading, time, torch
        import liger_dispatch as ld
        from liger_dispatch.core.table import TABLE, OpSpec
        TABLE.declare_op(OpSpec("dl_op(Tensor x) -> Tensor", "kernel", lambda a: None))
        ld.declare_op_locations("dl_op", {"mine": "backend_mod"})
        results = []
        b = threading.Thread(target=lambda: importlib.import_module("shared_mod"), daemon=True)
        a = threading.Thread(target=lambda: results.append(ld.dispatch.op("dl_op")(torch.ones(1))), daemon=True)
        b.start()
        time.sleep(0.1)
        a.start()
        for t in (a, b):
            t.join(timeout=30)
        print("deadlock" if a.is_alive() or b.is_alive() else results)
        """, cwd=tmp_path)
    assert out.strip() == "['mine']"
