"""`python -m liger_dispatch`: the op x backend matrix of this machine; `... demo`: the demo run;
`... tune`: time the backends here and write a tuned table (liger_dispatch/tuning/tune.py)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

from liger_dispatch import dispatch, settings, testing
from liger_dispatch.capability import default_device, default_dtype, dtype_name
from liger_dispatch.core import selection
from liger_dispatch.core.table import TABLE
from liger_dispatch.errors import LigerDispatchError
from liger_dispatch.tools import demos
from liger_dispatch.tuning import tune

PROG = "python -m liger_dispatch"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def device_problem(name: str) -> Optional[str]:
    """Why --device `name` cannot be evaluated on this machine, or None."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return f"--device {name!r} is not a device; expected cpu, cuda or cuda:N"
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"--device {name!r}: liger-dispatch's backends run on cpu or cuda devices"
    if not torch.cuda.is_available():
        build = "was built without CUDA" if torch.version.cuda is None else "finds no CUDA device"
        return f"--device {name!r}: this torch ({torch.__version__}) {build}; use --device cpu"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def _short(reason: str, width: int = 110) -> str:
    if " failed to import (" in reason:
        reason = "import failed: " + reason.split(" failed to import (", 1)[1].rstrip(")")
    return reason if len(reason) <= width else reason[: width - 1] + "…"


def summary(op: str, device: str, dtype: torch.dtype) -> str:
    """Which backend serves `op` here under the backend preference in force (LIGER_BACKEND, LIGER_BACKEND_<OP>),
    or why it falls back; an unknown backend name raises UnknownBackendError, as a call would."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return f"{op}: nothing serves (no CUDA device on this machine)"
    usable = dispatch.available_backends(op, device=device, dtype=dtype)
    choice = selection.resolve(op, (), device=torch.device(device), dtypes=(dtype,))
    res, chosen = choice.resolution, choice.impl
    served = chosen.backend if chosen is not None else "nothing"
    if not res.requested:
        return f"{op}: auto picks [bold]{served}[/bold] (usable, best first: {', '.join(usable) or 'none'})"
    asked = f"{res.source} = {', '.join(res.requested)}"
    if not choice.is_fallback:
        return f"{op}: {asked}: [bold]{served}[/bold] serves"
    why = "; ".join(f"{r.backend}: {r.reason}" for r in choice.rejected if r.backend in res.requested)
    if settings.STRICT.get():
        return f"{op}: {asked}: [red]calls raise[/red] ({settings.STRICT.name} is set; {why})"
    return f"{op}: {asked}: falls back to [bold]{served}[/bold] ({why})"


AVAILABLE, NOT_REGISTERED = "available", "-"


def matrix_rows(device: str, dtype: torch.dtype) -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """(rows, notes): per op (level, name, one cell per backend), the cells "available", "-" (no implementation
    registered) or "(k)", the k-th of `notes` (each distinct reason once, in order of first appearance)."""
    backends = TABLE.backend_names()
    notes: list[str] = []
    rows = []
    for level in ("user", "kernel"):
        for name in (n for n in TABLE.op_names(level) if not TABLE.spec(n).internal):
            status = dispatch.backend_status(name, device, dtype)
            cells = []
            for backend in backends:
                if backend not in status:
                    cells.append(NOT_REGISTERED)
                elif status[backend] is None:
                    cells.append(AVAILABLE)
                else:
                    reason = _short(status[backend])
                    if reason not in notes:
                        notes.append(reason)
                    cells.append(f"({notes.index(reason) + 1})")
            rows.append((level, name, cells))
    return rows, notes


def matrix(device: str, dtype: torch.dtype) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    backends = TABLE.backend_names()
    rows, notes = matrix_rows(device, dtype)
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "no GPU"
    table = Table(title=f"liger-dispatch backends on {device} ({gpu}), {dtype_name(dtype)}", box=box.SIMPLE_HEAD,
                  title_justify="left", pad_edge=False)
    op_width = max(len(name) for _, name, _ in rows)
    table.add_column("op", no_wrap=True, min_width=op_width)
    widths = [max(len(b), len(AVAILABLE), *(len(cells[i]) for _, _, cells in rows)) for i, b in enumerate(backends)]
    for backend, width in zip(backends, widths):
        table.add_column(backend, no_wrap=True, min_width=width)
    summaries = {name: TABLE.spec(name).summary for _, name, _ in rows}
    spare = console.width - (op_width + sum(widths) + 3 * (len(backends) + 1))
    with_summary = spare >= max(map(len, summaries.values()))  # on one line each, or not at all
    if with_summary:
        table.add_column("what", no_wrap=True, style="dim")
    style = {AVAILABLE: "green", NOT_REGISTERED: "dim"}
    for i, (level, name, cells) in enumerate(rows):
        if level == "kernel" and rows[i - 1][0] == "user":
            table.add_section()
            table.add_row("[dim]kernel-level ops[/dim]", *([""] * (len(backends) + with_summary)))
        styled = [f"[{style.get(cell, 'yellow')}]{cell}[/]" for cell in cells]
        table.add_row(name, *styled, *((summaries[name],) if with_summary else ()))
    console.print(table)
    for k, note in enumerate(notes, 1):
        console.print(f"[yellow]({k})[/yellow] {note}", highlight=False)
    if NOT_REGISTERED in (cell for _, _, cells in rows for cell in cells):
        console.print(f"{NOT_REGISTERED}: the backend registers no implementation of this op", highlight=False)
    for name in TABLE.op_names("user"):
        console.print(summary(name, device, dtype), highlight=False)
        console.print(f"[dim]  {name}{TABLE.spec(name).schema.describe()}[/dim]", highlight=False)
    failures = {m: TABLE.module_error(m) for op in TABLE.op_names() for m in TABLE.locations(op).values()}
    for module, error in sorted((m, e) for m, e in failures.items() if e):
        console.print(f"[dim]{module}: {error}[/dim]")
    env = {k: v for k, v in os.environ.items()
           if k.startswith("LIGER_") or k in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    console.print(f"environment: {env or 'no LIGER_* variables set'}")
    for name in settings.unknown_variables(selection.env_key(op) for op in TABLE.op_names()):
        console.print(f"[yellow]{name} is not a variable liger-dispatch reads (a typo?)[/yellow]")


def main(argv: Optional[list[str]] = None) -> int:
    where = argparse.ArgumentParser(add_help=False)  # given before or after the subcommand
    where.add_argument("--device", default=argparse.SUPPRESS, help="cuda or cpu (default: cuda when there is one)")
    where.add_argument("--dtype", default=argparse.SUPPRESS, choices=list(DTYPES),
                       help="dtype to evaluate (default: bf16 on cuda, fp32 on cpu)")
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, parents=[where])
    sub = parser.add_subparsers(dest="command")
    demos.add_arguments(sub.add_parser("demo", parents=[where],
                                       help="a short training + distillation run on this machine"))
    tune.add_arguments(sub.add_parser("tune", parents=[where], help="time the backends here; write a tuned table"))
    testing.add_arguments(sub.add_parser("verify", parents=[where],
                                         help="run the conformance suite on one backend (yours: --import it)"))
    args = parser.parse_args(argv)
    device = getattr(args, "device", None) or str(default_device())
    problem = device_problem(device)
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if getattr(args, "dtype", None) else default_dtype(torch.device(device))
    try:
        settings.check_all()
        if args.command == "demo":
            return demos.run(args, device, dtype)
        if args.command == "tune":
            return tune.run(args, device, dtype)
        if args.command == "verify":
            return testing.run(args, device)
        matrix(device, dtype)
    except LigerDispatchError as exc:  # a bad LIGER_* variable or backend name: the user's to fix, not a crash
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
