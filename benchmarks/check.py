"""Correctness before timing: a provider's outputs and gradients against the eager formulas."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from benchmarks import workloads
from benchmarks.workloads import Inputs

# ||got - want|| / ||want||; bf16/fp16 operands land between 1e-3 and 1e-2, fp32 (or tf32 inside) near 3e-4.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 2e-3}


@dataclass
class Result:
    """What one call produced: its outputs and the gradients of the inputs' leaves (empty in fwd mode)."""

    outs: list[torch.Tensor]
    grads: list[torch.Tensor]


def run(fn: Callable, inputs: Inputs, mode: str) -> Result:
    """One call on `inputs` in `mode` (fwd: no autograd); leaves' grads are reset before and after."""
    for leaf in inputs.leaves:
        leaf.grad = None
    if mode == "fwd":
        with torch.no_grad():
            return Result([o.detach() for o in workloads.outputs(workloads.forward(fn, inputs))], [])
    out = workloads.forward(fn, inputs)
    workloads.backward(out, inputs)
    grads = [leaf.grad for leaf in inputs.leaves]
    for leaf in inputs.leaves:
        leaf.grad = None
    return Result([o.detach() for o in workloads.outputs(out)], grads)


def rel_err(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """Relative norm of the difference; NaN when `got` is missing, misshapen or not finite."""
    if got is None or want is None:
        return 0.0 if got is None and want is None else math.nan
    if got.shape != want.shape:
        return math.nan
    diff = torch.linalg.vector_norm(got.float() - want.float()).item()
    scale = torch.linalg.vector_norm(want.float()).item()
    if not math.isfinite(diff):
        return math.nan
    return diff / scale if scale > 0 else diff


def compare(got: Result, want: Result) -> tuple[float, float]:
    """(worst output error, worst gradient error); NaN propagates."""
    def worst(pairs):
        errs = [rel_err(g, w) for g, w in pairs]
        return max(errs, key=lambda e: math.inf if math.isnan(e) else e, default=0.0)

    if len(got.outs) != len(want.outs):
        return math.nan, math.nan
    return worst(zip(got.outs, want.outs)), worst(zip(got.grads, want.grads))


def passes(errors: tuple[float, float], dtype: torch.dtype) -> bool:
    tol = TOLERANCE[dtype]
    return all(e <= tol for e in errors)  # NaN compares False
