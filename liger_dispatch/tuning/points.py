"""What an op family declares for tuning (OpSpec.tuning): how a tuned table buckets its calls, and the points
`python -m liger_dispatch tune` measures it at, with the helpers the families build their inputs from."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from liger_dispatch.timing import Inputs

CHECK_LOGITS = 2**29  # points whose [N, V] logits exceed this many elements are timed without the reference check


@dataclass(frozen=True)
class Tuning:
    """bucket(*args, **kwargs) -> (N bucket, the other bucket fields as (name, value) pairs): the sizes and options
    of a call that change which kernel wins (tuned.py).
    groups(args, dtype) -> iterator of make(device) -> iterator of Points: the points `tune` measures, one group a
    shared allocation; `args` is tune's parsed command line, the family's own `arguments` included.
    arguments: ((flags, argparse keyword arguments), ...) the family adds to tune's command line."""

    bucket: Callable[..., tuple[int, tuple]]
    groups: Callable[..., Iterator[Callable[[torch.device], Iterator["Point"]]]]
    arguments: tuple = ()


@dataclass
class Point:
    """One op at one shape: its call (inputs, leaves, upstream gradients), and whether the reference checks it."""

    op: str
    shape: str
    inputs: Inputs
    check: bool = True

    def describe(self) -> str:
        return f"{self.op} {self.shape} {self.inputs.kwargs or ''}".rstrip()


def pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def rows(t: torch.Tensor, trailing: int = 1) -> int:
    """The size of the leading dims, flattened."""
    shape = t.shape
    return shape[0] if len(shape) == trailing + 1 else math.prod(shape[:-trailing])


def randn(shape, dtype, device, std=1.0):
    return (torch.randn(shape, device=device) * std).to(dtype)


def lm_head(n, hidden, vocab, dtype, device):
    """x [N, H] ~ N(0, 1) and W [V, H] ~ N(0, 1/H): logits of unit scale, as a trained head gives."""
    x = randn((n, hidden), dtype, device).requires_grad_()
    return x, randn((vocab, hidden), dtype, device, hidden ** -0.5).requires_grad_()


def labels(n, vocab, device):
    out = torch.randint(0, vocab, (n,), device=device)
    return out.masked_fill_(torch.rand(n, device=device) < 0.05, -100)  # a few ignored rows, as in training


def lm_head_groups(point: Callable[..., Iterator[Point]]):
    """groups() of an LM-head family: one group a row count of tune's --n, at its --hidden and --vocab;
    point(n, hidden, vocab, dtype, device, args) yields the group's points."""

    def groups(args, dtype):
        for n in args.n:
            yield lambda device, n=n: point(n, args.hidden, args.vocab, dtype, device, args)

    return groups


def lm_shape(n, hidden, vocab) -> tuple[str, bool]:
    """An LM-head point's shape text, and whether the reference checks it (its logits fit CHECK_LOGITS)."""
    return f"N={n} H={hidden} V={vocab}", n * vocab <= CHECK_LOGITS
