"""Test setup: without a GPU, Triton (and Helion's generated Triton) kernels run in Triton's interpreter
on CPU tensors; the variable must be set before any kernel is defined, so it is set here, first."""

import os
import tempfile

import torch

# A compile cache of the test run's own: inductor's shared one in /tmp can hold graphs of another checkout's ops.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="liger-dispatch-inductor-"))

if not torch.cuda.is_available() and os.environ.get("HELION_INTERPRET") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402

from liger_dispatch.core import selection  # noqa: E402
from liger_dispatch.core.table import TABLE  # noqa: E402


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh random inputs per test, the same on every run (a failure can be reproduced)."""
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture(autouse=True)
def clean_selection(monkeypatch):
    """Each test starts with no LIGER_* preference in the environment and no memoized selection."""
    for key in list(os.environ):
        if key.startswith("LIGER_BACKEND") or key in ("LIGER_STRICT", "LIGER_CHUNK_ROWS", "LIGER_CHUNK_COLUMNS",
                                                      "LIGER_CHUNK_BUDGET_MB", "LIGER_TUNED_TABLE"):
            monkeypatch.delenv(key)
    selection.reset()
    yield
    selection.reset()


@pytest.fixture
def isolated_table():
    """Lets a test declare ops and register backends, and undoes it afterwards."""
    for op in TABLE.op_names():  # import every backend module first: a module imports (and registers) once
        TABLE.discover(op)
    saved = {k: copy.copy(v) for k, v in TABLE.__dict__.items() if k != "_lock"}
    saved["_locations"] = {op: dict(locs) for op, locs in TABLE._locations.items()}
    saved["_registered"] = {op: list(impls) for op, impls in TABLE._registered.items()}
    yield TABLE
    TABLE.__dict__.update(saved)
    TABLE._candidates.clear()
    TABLE.version += 1
    selection.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
