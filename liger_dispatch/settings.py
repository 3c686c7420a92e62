"""Every environment variable liger-dispatch reads: its name, the values it accepts, its default and effect.

A variable is read on each use (a change takes effect on the next call) and parsed once per distinct raw string
(a use on the per-call path costs a lookup and a dict hit); a bad value raises ConfigError. The backend
preferences (LIGER_BACKEND, LIGER_BACKEND_<OP>) are parsed by selection.py.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, Iterable, Iterator, Optional

from liger_dispatch.errors import ConfigError

_ENV_DATA = getattr(os.environ, "_data", None)  # the raw mapping behind os.environ: a lookup costs ~50 ns
_ENV_ENCODE = getattr(os.environ, "encodekey", None)
_encoded_keys: dict[str, object] = {}


def getenv(key: str) -> Optional[str]:
    """os.environ.get, fast enough for the per-call path."""
    if _ENV_DATA is None or _ENV_ENCODE is None:
        return os.environ.get(key)
    encoded = _encoded_keys.get(key)
    if encoded is None:
        encoded = _encoded_keys[key] = _ENV_ENCODE(key)
    value = _ENV_DATA.get(encoded)
    return None if value is None else os.environ.decodevalue(value)


TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def boolean(raw: str) -> bool:
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(raw)


def switched_on(raw: str) -> bool:
    """A boolean of another tool, read as Triton reads its own: one of TRUE turns it on, anything else not."""
    return raw.strip().lower() in TRUE


def positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError(raw)
    return value


def positive_number(raw: str) -> float:
    value = float(raw)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(raw)
    return value


def _choice(raw: str, options: tuple[str, ...]) -> str:
    if raw.lower() not in options:
        raise ValueError(raw)
    return raw.lower()


def file_list(raw: str) -> tuple[str, ...]:
    """Paths separated by os.pathsep (empty entries skipped); a directory is not a file."""
    paths = tuple(p for p in raw.split(os.pathsep) if p)
    if not paths or any(os.path.isdir(p) for p in paths):
        raise ValueError(raw)
    return paths


class Setting:
    """One environment variable: `get()` is its parsed value, or `default` when it is unset or empty."""

    __slots__ = ("name", "parse", "accepts", "default", "effect", "_parsed")

    def __init__(self, name: str, parse: Callable[[str], object], accepts: str, default, effect: str):
        self.name, self.parse, self.accepts, self.default, self.effect = name, parse, accepts, default, effect
        self._parsed: dict[str, object] = {}

    def get(self):
        raw = getenv(self.name)
        if not raw:
            return self.default
        value = self._parsed.get(raw, _MISSING)
        if value is _MISSING:
            try:
                value = self.parse(raw)
            except ValueError:
                raise ConfigError(f"{self.name}={raw!r} is not valid: expected {self.accepts}") from None
            if len(self._parsed) >= 64:  # a value that keeps changing: start over
                self._parsed.clear()
            self._parsed[raw] = value
        return value

    # Traced by torch.compile, a setting is read once, while tracing, and its value kept in the graph, as dynamo
    # keeps os.environ's (the mark of torch.compiler.assume_constant_result, set without importing dynamo). Traced
    # instead, the lookups above would guard on the whole environment and on the parse cache: any variable set
    # later (inductor sets two in its first compile) would recompile the graph.
    get._dynamo_marked_constant = True

    @contextlib.contextmanager
    def set_to(self, raw: str) -> Iterator[None]:
        """The variable set to `raw` for the block (benchmarks, the conformance suite), then as it was."""
        before = os.environ.get(self.name)
        os.environ[self.name] = raw
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = before

    def __repr__(self) -> str:
        return f"Setting({self.name})"


_MISSING = object()
_BOOLEAN = "one of 0/false/no/off or 1/true/yes/on (any case)"

STRICT = Setting("LIGER_STRICT", boolean, _BOOLEAN, False,
                 "a call that would fall back raises BackendUnavailableError instead (unset: it falls back, with "
                 "one FallbackWarning per (op, backend, reason))")
CHECKS = Setting("LIGER_CHECKS", lambda raw: _choice(raw, ("device", "full")), "device (default) or full",
                 "device", "where value checks run on an accelerator: device-side asserts, or full host checks "
                 "with a Python error (a sync per call; debugging)")
CHUNK_BUDGET_MB = Setting("LIGER_CHUNK_BUDGET_MB", positive_number, "a positive number of MiB", 512.0,
                          "memory budget for a chunk's logits buffers in the fused-linear composition (the "
                          "vocabulary-chunk one: beyond its weight gradient's memory)")
CHUNK_ROWS = Setting("LIGER_CHUNK_ROWS", positive_int, "a positive integer", None,
                     "force the rows of a chunk of the fused-linear composition (tests, tuning)")
CHUNK_COLUMNS = Setting("LIGER_CHUNK_COLUMNS", positive_int, "a positive integer", None,
                        "force the vocabulary columns of a chunk where the composition chunks the vocabulary "
                        "(compose/vocab_chunks.py; tests)")
TUNED_TABLE = Setting("LIGER_TUNED_TABLE", file_list, f"tuned-table files separated by {os.pathsep!r}", (),
                      "more tuned tables for auto selection, winning over the committed ones (tuned.py)")
HELION_AUTOTUNE = Setting("LIGER_HELION_AUTOTUNE", boolean, _BOOLEAN, False,
                          "let Helion autotune at run time instead of using the committed configs")
HELION_CONFIG_DIR = Setting("LIGER_HELION_CONFIG_DIR", str, "a directory", None,
                            "where the Helion backend reads its config tables (default: its configs/)")
CUTEDSL_TVM_FFI = Setting("LIGER_CUTEDSL_TVM_FFI", boolean, _BOOLEAN, True,
                          "launch CuTeDSL kernels through TVM-FFI when apache-tvm-ffi is installed")
CUTEDSL_DUMP_DIR = Setting("LIGER_CUTEDSL_DUMP_DIR", str, "a directory", None,
                           "keep each compiled CuTeDSL kernel's cubin there")
# Other tools' switches that decide where our backends can run; read as those tools read them.
TRITON_INTERPRET = Setting("TRITON_INTERPRET", switched_on, "1/true/yes/on to turn it on", False,
                           "Triton's interpreter: the triton and helion backends accept CPU tensors")
HELION_INTERPRET = Setting("HELION_INTERPRET", switched_on, "1/true/yes/on to turn it on", False,
                           "Helion's eager interpreter: the helion backend accepts CPU tensors")

SETTINGS = (STRICT, CHECKS, CHUNK_BUDGET_MB, CHUNK_ROWS, CHUNK_COLUMNS, TUNED_TABLE, HELION_AUTOTUNE,
            HELION_CONFIG_DIR, CUTEDSL_TVM_FFI, CUTEDSL_DUMP_DIR, TRITON_INTERPRET, HELION_INTERPRET)
BACKEND_PREFIX = "LIGER_BACKEND"  # LIGER_BACKEND and LIGER_BACKEND_<OP>: backend names, checked by selection.py


def check_all() -> None:
    """Parse every variable that is set: ConfigError on the first bad one."""
    for setting in SETTINGS:
        setting.get()


def unknown_variables(backend_keys: Iterable[str]) -> list[str]:
    """LIGER_* variables in the environment that liger-dispatch does not read (a typo, say); backend_keys are the
    LIGER_BACKEND_<OP> names of the declared ops."""
    known = {s.name for s in SETTINGS} | {BACKEND_PREFIX, *backend_keys}
    return sorted(k for k in os.environ if k.startswith("LIGER_") and k not in known)
