"""Shape presets and the cases (one op at one size, dtype and mode) a run measures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

LM_OPS = ("flce", "fused_linear_jsd", "fused_linear_kl_div")
HEAD_OPS = (*LM_OPS, "fused_linear_logprobs")  # the ops on an LM head: its shape presets
MODEL_OPS = (*LM_OPS, "mhc_coeffs")  # the ops liger-kernel 0.8.5 has too
OPS = (*MODEL_OPS, "fused_linear_logprobs", "dispatch_overhead")
MODES = ("fwd", "bwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU_NS = (1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class LMHead:
    """An LM head: hidden size H, vocabulary V, and the default sweep over N (rows = batch x sequence)."""

    name: str
    hidden: int
    vocab: int
    ns: tuple[int, ...] = GPU_NS


@dataclass(frozen=True)
class MHC:
    """mHC coefficients at batch B with HC streams, over (T, C) points: x is [B, T, HC, C]."""

    name: str
    batch: int
    hc: int
    points: tuple[tuple[int, int], ...]


LM_PRESETS = {
    "llama3": LMHead("llama3", 4096, 128256),
    "qwen3": LMHead("qwen3", 4096, 151936),
    "gemma3": LMHead("gemma3", 2304, 262208),
    # V not a multiple of any block size; small enough for the CPU in seconds.
    "tiny": LMHead("tiny", 64, 1000, (16, 48)),
}
MHC_GPU = MHC("b4-hc4", 4, 4, ((512, 1024), (1024, 1024), (1024, 2048), (2048, 2048), (2048, 4096)))
MHC_TINY = MHC("tiny", 1, 4, ((8, 32), (16, 64)))


@dataclass(frozen=True)
class Case:
    """One row of results: `n` is the x axis of the plots (N rows for the LM-head ops, T*C for mHC)."""

    op: str
    shape: str
    n: int
    dims: tuple[tuple[str, int], ...]
    dtype: torch.dtype
    mode: str

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in DTYPES.items() if v == self.dtype)

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.dims)


def parse_tc(text: str) -> tuple[int, int]:
    t, c = text.lower().split("x")
    return int(t), int(c)


def cases(op: str, shapes: Sequence[str], ns: Sequence[int] | None, tcs: Sequence[tuple[int, int]] | None,
          dtypes: Iterable[torch.dtype], modes: Iterable[str]) -> list[Case]:
    """The cases of one op, in run order (N ascending, so a size that cannot fit is predicted from smaller ones)."""
    points: list[tuple[str, int, tuple]] = []
    if op in HEAD_OPS:
        for name in shapes:
            head = LM_PRESETS[name]
            for n in sorted(ns or head.ns):
                points.append((name, n, (("N", n), ("H", head.hidden), ("V", head.vocab))))
    elif op == "mhc_coeffs":
        # One mHC sweep serves every GPU preset (its shapes do not depend on the LM head).
        presets = []
        if "tiny" in shapes:
            presets.append(MHC_TINY)
        if any(s != "tiny" for s in shapes):
            presets.append(MHC_GPU)
        for preset in presets:
            for t, c in sorted(tcs or preset.points, key=lambda p: (p[0] * p[1], p)):
                dims = (("B", preset.batch), ("T", t), ("HC", preset.hc), ("C", c))
                points.append((preset.name, t * c, dims))
    else:
        raise ValueError(f"no shapes for op {op!r}")
    return [Case(op, shape, n, dims, dtype, mode)
            for dtype in dtypes for mode in modes for shape, n, dims in points]


def halved(case: Case) -> Case | None:
    """The same LM-head case at half the rows (None for mHC or a single row): where a check can still fit."""
    if case.op not in HEAD_OPS or case.n < 2:
        return None
    n = case.n // 2
    dims = tuple((k, n if k == "N" else v) for k, v in case.dims)
    return Case(case.op, case.shape, n, dims, case.dtype, case.mode)
