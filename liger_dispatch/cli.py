"""`python -m liger_dispatch`: the op x backend matrix of this machine; `... demo`: the demo run;
`... tune`: time the backends here and write a tuned table (liger_dispatch/tune.py)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

from liger_dispatch import tune
from liger_dispatch.capability import dtype_name


def _dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _short(reason: str, width: int = 60) -> str:
    if " failed to import (" in reason:
        reason = "import failed: " + reason.split(" failed to import (", 1)[1].rstrip(")")
    return reason if len(reason) <= width else reason[: width - 1] + "…"


def matrix(device: str, dtype: torch.dtype) -> None:
    from rich.console import Console
    from rich.table import Table

    import liger_dispatch as ld
    from liger_dispatch.dispatch import backend_status
    from liger_dispatch.table import TABLE

    console = Console(width=max(Console().width, 150))
    backends = TABLE.backend_names()
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "no GPU"
    table = Table(title=f"liger-dispatch backends on {device} ({gpu}), {dtype_name(dtype)}",
                  show_lines=True)
    table.add_column("op")
    for backend in backends:
        table.add_column(backend, overflow="fold")
    for level in ("user", "kernel"):
        for name in TABLE.op_names(level):
            status = backend_status(name, device, dtype)
            cells = []
            for backend in backends:
                if backend not in status:
                    cells.append("[dim]-[/dim]")
                elif status[backend] is None:
                    cells.append("[green]available[/green]")
                else:
                    cells.append(f"[yellow]{_short(status[backend])}[/yellow]")
            label = name + ("" if level == "user" else " [dim](kernel)[/dim]")
            table.add_row(f"{label}\n[dim]{TABLE.spec(name).summary}[/dim]", *cells)
    console.print(table)
    for name in TABLE.op_names("user"):
        usable = ld.available_backends(name, device=device, dtype=dtype)
        console.print(f"{name}: auto picks [bold]{usable[0] if usable else 'nothing'}[/bold]"
                      f" (usable, best first: {', '.join(usable) or 'none'})")
    failures = {m: TABLE.module_error(m) for op in TABLE.op_names() for m in TABLE.locations(op).values()}
    for module, error in sorted((m, e) for m, e in failures.items() if e):
        console.print(f"[dim]{module}: {error}[/dim]")
    env = {k: v for k, v in os.environ.items() if k.startswith("LIGER_") or k in ("TRITON_INTERPRET", "HELION_INTERPRET")}
    console.print(f"environment: {env or 'no LIGER_* variables set'}")


def main(argv: Optional[list[str]] = None) -> int:
    where = argparse.ArgumentParser(add_help=False)  # given before or after the subcommand
    where.add_argument("--device", default=argparse.SUPPRESS, help="cuda or cpu (default: cuda when there is one)")
    where.add_argument("--dtype", default=argparse.SUPPRESS, choices=["bf16", "fp16", "fp32"],
                       help="dtype to evaluate (default: bf16 on cuda, fp32 on cpu)")
    parser = argparse.ArgumentParser(prog="python -m liger_dispatch", description=__doc__, parents=[where])
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", parents=[where], help="a short distillation + LM-head training run on this machine")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--loss", default="jsd", choices=["jsd", "kl"], help="distillation loss")
    tune.add_arguments(sub.add_parser("tune", parents=[where], help="time the backends here; write a tuned table"))
    args = parser.parse_args(argv)
    device = getattr(args, "device", None) or default_device()
    dtype = _dtype(getattr(args, "dtype", None) or ("bf16" if device.startswith("cuda") else "fp32"))
    if args.command == "demo":
        from liger_dispatch.demo import run

        return run(steps=args.steps, device=device, dtype=dtype, distill=args.loss)
    if args.command == "tune":
        return tune.run(args, device, dtype)
    matrix(device, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
