"""What an op family's conformance cases are made of (liger_dispatch.testing runs them): `Case`, the random
`Inputs` a case builds from, and the helpers several families' cases share.

A leaf: it imports torch only, so every family module can import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
FP16 = (torch.float16,)
FP32 = (torch.float32,)


@dataclass(frozen=True)
class Inputs:
    """Makers of a case's random inputs on one device and dtype, and the shapes of that device's cases."""

    device: torch.device
    dtype: torch.dtype
    N: int
    H: int
    V: int
    real: bool = False  # the sizes of a GPU's cases (a family with shapes of its own picks them by this)

    def randn(self, *shape, dtype=None, scale=1.0):
        dtype = self.dtype if dtype is None else dtype
        return torch.randn(*shape, device=self.device, dtype=torch.float32).mul_(scale).to(dtype)

    def weight(self, vocab=None, hidden=None, dtype=None, scale=1.0):
        """A [vocab, hidden] head whose logits are ~scale."""
        hidden = self.H if hidden is None else hidden
        return self.randn(self.V if vocab is None else vocab, hidden, dtype=dtype, scale=scale * hidden ** -0.5)

    def labels(self, n, vocab=None, ignored=(), all_ignored=False, strided=False):
        """strided: the labels as a column of a [n, 3] matrix whose other columns are out of range (a 1-D view of
        stride 3: a kernel that reads it as contiguous memory sees them)."""
        vocab = self.V if vocab is None else vocab
        y = torch.randint(0, vocab, (n,), device=self.device)
        if all_ignored:
            y.fill_(-100)
        for i in ignored:
            y[i] = -100
        if strided:
            matrix = torch.full((n, 3), vocab + 5, device=self.device, dtype=y.dtype)
            matrix[:, 0] = y
            y = matrix[:, 0]
        return y

    def kl_target(self, n, log_target, zeros, dtype=torch.float32):
        probs = torch.softmax(self.randn(n, self.V, dtype=torch.float32, scale=2.0), dim=-1)
        if zeros:
            probs[:, ::5] = 0
            probs = probs / probs.sum(-1, keepdim=True)
        return (probs.clamp_min(1e-30).log() if log_target else probs).to(dtype)

    def scalar(self, value):
        return torch.tensor(value, device=self.device)


@dataclass(frozen=True)
class Case:
    """One conformance case of a user-level op.

    build(inputs) -> (the op's tensor arguments by name, in schema order; its keyword options).
    grads: the arguments whose gradients are compared. kind: "reference" (compared with the float64 formulas) or
    "empty" (zero rows: zero loss and gradients). dtypes: where it runs; None is every dtype on a GPU and float32
    on the CPU, plus bf16 and fp16 there when `smoke` (the interpreter is slow). extra_dtypes are added to those.
    """

    name: str
    build: Callable[[Inputs], tuple[dict, dict]]
    grads: tuple[str, ...] = ()
    upstream: float = 0.7
    kind: str = "reference"
    smoke: bool = False
    dtypes: Optional[tuple] = None
    extra_dtypes: tuple = ()
    sample: bool = False  # the op's smallest call: the opcheck, compile and CUDA-graph checks use it
    used: Optional[tuple] = None  # the outputs backpropagated through (None: all)
    row_upstream: float = 1.0  # the scale of the random upstream gradient of a per-row output

    def dtypes_on(self, device) -> tuple:
        if self.dtypes is not None:
            return self.dtypes
        if torch.device(device).type == "cuda":
            every = (torch.float32, *LOW_PRECISION)
        else:
            every = (torch.float32, *LOW_PRECISION) if self.smoke else (torch.float32,)
        return tuple(dict.fromkeys((*every, *self.extra_dtypes)))


def leaf(t: torch.Tensor, grad=True) -> torch.Tensor:
    return t.detach().clone().requires_grad_(grad)


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a transposed storage: stride(-1) != 1."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def empty_head(m: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero rows of activations and a [V, H] head: the start of an "empty" case."""
    return m.randn(0, m.H), m.randn(m.V, m.H)


def empty_leaves(inputs: dict, frozen=()) -> dict:
    """An "empty" case's arguments: the None ones dropped; the floating ones but `frozen` (a teacher or a target,
    never differentiated) require grad."""
    return {k: leaf(v, v.is_floating_point() and k not in frozen) for k, v in inputs.items() if v is not None}


def overflow_head(m: Inputs, logit_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and a head whose logits are ~logit_scale, for the fp16 cases whose per-logit gradients are far
    above 1: fp16 buffers hold the gradient scaled up (compose/grad_bounds.py), and those must not overflow them
    (or dX) into inf / NaN."""
    return m.randn(m.N, m.H), m.weight(scale=logit_scale)


def beyond_fp16_head(m: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight rows of activations ~8000 and a [131, 16] head of weights ~1e-4, for the fp16 cases whose loss pushes
    hard on them: d loss / dW passes fp16's 65504 while the gradient after the upstream 0.25 does not. It must
    come back finite and right, as plain autograd gives it (the upstream scales before the GEMM): the forward may
    not round the gradient of the loss itself to fp16."""
    rows, hidden, vocab = 8, 16, 131
    x = torch.rand(rows, hidden, device=m.device).add_(0.5).mul_(8000.0).to(m.dtype)
    return x, m.randn(vocab, hidden, scale=1e-4)


def sample_labels(m: Inputs, rows=6, vocab=40) -> torch.Tensor:
    """The labels of a kernel-level op's sample, row 1 ignored."""
    return m.labels(rows, vocab, ignored=(1,))
