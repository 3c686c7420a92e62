"""Measured auto-selection: per-device tables of the fastest backend for each (op, dtype, shape bucket).

`python -m liger_dispatch tune` (tune.py) writes a table keyed by what decides the kernels' times: the GPU's name
and compute capability, the versions of the DSLs that generate the kernels (triton, helion, nvidia-cutlass-dsl) and
torch's major.minor (its cuBLAS GEMMs and autograd; its patch level and build tag, +cu130 or +cpu, ship the same
kernels). A table whose key differs from this process's is ignored, never applied. The committed tables are
tables/*.json; LIGER_TUNED_TABLE (settings.TUNED_TABLE) names more files (os.pathsep-separated), whose entries win.

Auto selection (no backend=, use_backend or LIGER_BACKEND*) consults the table before static priority: the
backends the entry measured go first, fastest first (within TIE of the fastest: tied, in priority order), then
the others in priority order, the reference last. A backend whose shape predicate turns a call down still yields
to the next one.

Shape buckets (bucket_of): the rows N (the flattened leading dims) rounded up to a power of two, and the sizes and
options that change which kernel wins, as the op's family declares them (OpSpec.tuning.bucket). A call whose N
bucket has no entry takes the adjacent power of two's, the larger on a tie; further away, static priority decides.
Kernel-level ops have no buckets. Per-call cost: lookup_key, None unless a table for this device has the op, else
the bucket tuple (~1 us to build), joins the selector's memo key.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from liger_dispatch import settings
from liger_dispatch.capability import device_capability, dtype_name
from liger_dispatch.core.table import TABLE
from liger_dispatch.errors import LigerDispatchError

FORMAT = 1
# Times within 2 % of the fastest rank as equal: one point varies 1-5 % between runs on the H200.
TIE = 0.02
PACKAGED = Path(__file__).with_name("tables")
LIBRARIES = ("torch", "triton", "helion", "nvidia-cutlass-dsl")


class TunedTableError(LigerDispatchError):
    """A tuned table file that cannot be read or does not have the table format."""


def major_minor(version: Optional[str]) -> Optional[str]:
    """"2.11.0+cu130" -> "2.11" (a version without a major.minor is kept as it is)."""
    match = re.match(r"(\d+)\.(\d+)", version) if isinstance(version, str) else None
    return f"{match[1]}.{match[2]}" if match else version


def _version(distribution: str) -> Optional[str]:
    if distribution == "torch":
        return major_minor(torch.__version__)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_key(device: torch.device) -> dict:
    """What a table must match to apply to calls on `device`: GPU name, compute capability, library versions."""
    cc = device_capability(device)
    name = torch.cuda.get_device_name(device) if cc else device.type
    return {"device": name, "capability": list(cc) if cc else None, **{lib: _version(lib) for lib in LIBRARIES}}


def normal_key(key) -> dict:
    """A table's key as this version compares it: torch at major.minor (tables made before wrote its full version)."""
    key = dict(key) if isinstance(key, dict) else {}
    if "torch" in key:
        key["torch"] = major_minor(key["torch"])
    return key


def same_key(a: dict, b: dict) -> bool:
    return normal_key(a) == normal_key(b)


def describe_key(key: dict) -> str:
    cc = key.get("capability")
    where = key.get("device", "?") + (f" sm_{cc[0]}{cc[1]}" if cc else "")
    return where + ", " + ", ".join(f"{lib} {key.get(lib)}" for lib in LIBRARIES)


def bucket_of(op: str, args: Sequence, kwargs: dict) -> Optional[tuple[int, tuple]]:
    """(N bucket, the op's other bucket fields) of a call, or None for an op without buckets."""
    tuning = TABLE.spec(op).tuning
    return None if tuning is None else tuning.bucket(*args, **kwargs)


def describe_rest(rest: tuple) -> str:
    """The bucket fields other than N as a table stores them: "v=131072 beta=mixture"."""
    return " ".join(f"{k}={v}" for k, v in rest)


def describe_bucket(n: int, rest: tuple) -> str:
    return f"n={n} {describe_rest(rest)}".rstrip()


@dataclass(frozen=True)
class Entry:
    """One measured point: the backends' times (ms, fwd+bwd median) where they served it."""

    op: str
    dtype: str
    n: int
    rest: tuple
    ms: tuple[tuple[str, float], ...]  # fastest first
    shape: str  # the sizes it was measured at
    source: str  # the file it came from
    unavailable: tuple[str, ...] = ()  # backends that could not run where it was measured (not staged, say)

    @property
    def fastest(self) -> str:
        return self.ms[0][0]

    def ranks(self) -> dict[str, int]:
        """Each measured backend's place, fastest 0; those within TIE of the fastest share place 0."""
        best = self.ms[0][1]
        return {b: 0 if t <= best * (1.0 + TIE) else i for i, (b, t) in enumerate(self.ms)}

    def describe(self) -> str:
        times = ", ".join(f"{b} {t:.3g} ms" for b, t in self.ms)
        return f"({self.op}, {self.dtype}, {describe_bucket(self.n, self.rest)}) measured at {self.shape}: {times}"


def read_table(path: Path) -> tuple[dict, list[dict]]:
    """(key, raw entries) of a table file; TunedTableError when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT:
            raise TunedTableError(f"{path}: format {data.get('format')!r}, expected {FORMAT}")
        return data["key"], list(data["entries"])
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise TunedTableError(f"{path}: not a tuned table ({type(exc).__name__}: {exc})") from exc


def dumps(table: dict) -> str:
    """A table as JSON text, one entry a line (diffs of a re-tuned table stay readable)."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in table.items() if k != "entries"]
    rows = ",\n".join(f"  {json.dumps(e)}" for e in table["entries"])
    return "{\n" + ",\n".join(head) + ',\n "entries": [\n' + rows + "\n ]\n}\n"


def _entry(raw: dict, source: str) -> Entry:
    ms = sorted(((b, float(t)) for b, t in raw["ms"].items()), key=lambda item: item[1])
    op, dtype, n = raw["op"], raw["dtype"], int(raw["n"])
    pairs = (item.split("=", 1) for item in raw.get("bucket", "").split())  # describe_rest's text
    rest = tuple((k, int(v) if v.isdigit() else v) for k, v in pairs)
    return Entry(op, dtype, n, rest, tuple(ms), raw.get("shape", ""), source, tuple(raw.get("unavailable", {})))


class DeviceTables:
    """The entries that apply on one device, indexed by (op, dtype, other bucket fields) -> {n: Entry}."""

    def __init__(self, key: dict, files: Sequence[Path]):
        self.applied: list[str] = []
        self.ignored: list[str] = []  # "path: why"
        self.index: dict[tuple, dict[int, Entry]] = {}
        for path in files:  # later files win
            try:
                table_key, raw_entries = read_table(path)
            except TunedTableError as exc:
                self.ignored.append(str(exc))
                continue
            if not same_key(table_key, key):
                self.ignored.append(f"{path}: made on {describe_key(table_key)}")
                continue
            self.applied.append(str(path))
            for i, raw in enumerate(raw_entries):
                try:
                    entry = _entry(raw, str(path))
                except (KeyError, ValueError, TypeError, AttributeError) as exc:
                    warnings.warn(f"tuned table {path}: entry {i} ({raw!r:.120}) is malformed "
                                  f"({type(exc).__name__}: {exc}); it is skipped", UserWarning, stacklevel=2)
                    continue
                if entry.ms:
                    self.index.setdefault((entry.op, entry.dtype, entry.rest), {})[entry.n] = entry
        self.ops = frozenset(op for op, _, _ in self.index)

    def entry(self, op: str, dtype: str, n: int, rest: tuple) -> Optional[Entry]:
        """The entry of this bucket, or of the adjacent power of two (the larger on a tie), or None."""
        by_n = self.index.get((op, dtype, rest), {})
        return by_n.get(n) or by_n.get(2 * n) or by_n.get(n // 2)


def table_files(extra: Sequence[str]) -> list[Path]:
    """The committed tables, then the user's (LIGER_TUNED_TABLE): later files win."""
    return sorted(PACKAGED.glob("*.json")) + [Path(p) for p in extra]


_lock = threading.Lock()
_loaded: dict[tuple, DeviceTables] = {}


def tables_for(device: torch.device, extra: tuple[str, ...]) -> DeviceTables:
    """The tables that apply on `device`, read once per (device, LIGER_TUNED_TABLE files)."""
    tables = _loaded.get((device, extra))
    if tables is None:
        with _lock:
            tables = _loaded.get((device, extra))
            if tables is None:
                tables = _loaded[device, extra] = DeviceTables(device_key(device), table_files(extra))
    return tables


def reset() -> None:
    """Forget the tables read (after writing a table file in this process)."""
    with _lock:
        _loaded.clear()


def lookup_key(op: str, device: torch.device, args: Sequence, kwargs: dict):
    """The part of a call's memo key the tables decide: None when no table for `device` has `op`, else
    (LIGER_TUNED_TABLE's files, N bucket, other bucket fields). Cheap when None: two dict lookups."""
    extra = settings.TUNED_TABLE.get()
    if op not in tables_for(device, extra).ops:
        return None
    n, rest = bucket_of(op, args, kwargs)
    return extra, n, rest


def choice(op: str, device: torch.device, dtypes: Sequence[torch.dtype], key) -> Optional[Entry]:
    """The entry that orders auto selection for a call with this lookup_key, or None."""
    if key is None or not dtypes:
        return None
    extra, n, rest = key
    return tables_for(device, extra).entry(op, dtype_name(dtypes[0]), n, rest)


def measured_first(items: list, entry: Optional[Entry], backend: Callable) -> tuple[list, Optional[Entry]]:
    """(items, already in static order, those whose backend(item) `entry` measured first, fastest first, ties
    within TIE in static order; the entry), or (items, None) when there is no entry or it was measured without a
    backend that can serve here: its ranking says nothing about that one."""
    if entry is None or any(backend(item) in entry.unavailable for item in items):
        return items, None
    rank = entry.ranks()
    return sorted(items, key=lambda item: rank.get(backend(item), len(rank))), entry  # stable: static order otherwise


def explain(op: str, device: torch.device, dtypes: Sequence[torch.dtype], key, entry: Optional[Entry]) -> list[str]:
    """explain()'s lines about the tuned tables for this call."""
    tables = tables_for(device, settings.TUNED_TABLE.get())
    lines = [f"  tuned tables ignored here: {why}" for why in tables.ignored]
    unapplied = choice(op, device, dtypes, key) if entry is None else None
    if entry is not None:
        tied = [b for b, r in entry.ranks().items() if r == 0]
        ties = f" (within {TIE:.0%}: {', '.join(tied)}, in priority order)" if len(tied) > 1 else ""
        lines.insert(0, f"  tuned: {entry.fastest} is fastest{ties} in {entry.source} entry {entry.describe()}")
    elif unapplied is not None:
        lines.insert(0, f"  tuned: {unapplied.source} entry {unapplied.describe()} was measured without "
                        f"{', '.join(unapplied.unavailable)}: static priority decides")
    elif key is not None:
        _, n, rest = key
        lines.insert(0, f"  tuned: no entry for ({op}, {dtype_name(dtypes[0]) if dtypes else '-'}, "
                        f"{describe_bucket(n, rest)}) in {', '.join(tables.applied)}: static priority decides")
    return lines
