"""Per-token log-probs and entropy (registry/logprobs.py) in Triton: one program per row of a logits slice, one pass
over the row per kernel.

    logprobs_stats: an online softmax in base 2 (running max, per-lane sums of exp2 and of exp2 * z, rescaled as the
        max moves, reduced once after the last block) -> (lse, z_target where this slice holds the target, mean z).
    logprobs_grad:  dz_j = (g (1[j = target] - p_j) - h p_j (z_j - mean)) / T from the global statistics, written
        over the logits; without grad_entropy the entropy term is not computed (nor h read).

The statistics pass is the last read of a row in the forward (the gradient pass runs in the backward, after other
chunks' GEMMs), so both passes load evict-first. Statistics leave in natural log; base 2 inside.
"""

import triton
import triton.language as tl

from liger_dispatch import register_backend

from .._launch import LaunchKnobs
from .._vp_rows import row_stats
from ._support import (
    CAPABILITY, LOG2E, LN2, PRIORITY, RowLaunch, load_block, online_softmax_step, row_launch, zero_cols,
)

LAUNCH = LaunchKnobs("triton logprobs ops", RowLaunch())  # both kernels' knobs (tests force small blocks)


@triton.jit
def logprobs_row_stats(X, cols, inv_temp, to_log2, V: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One pass over a row X of V logits in blocks of cols = arange(BLOCK): (lse2 = log2 sum_j exp2(z_j log2 e),
    mean = sum_j softmax(z)_j z_j), z = x / T."""
    m = -float("inf")
    d = tl.zeros([BLOCK], tl.float32)  # per-lane sum of exp2(u - m)
    t = tl.zeros([BLOCK], tl.float32)  # per-lane sum of exp2(u - m) * z
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        x, mask = load_block(X, start, cols, V, "evict_first")
        m, alpha, e = online_softmax_step(m, tl.where(mask, x * to_log2, -float("inf")))
        d = d * alpha + e
        t = t * alpha + e * (x * inv_temp)  # masked lanes: e = 0 and x = 0
    total = tl.sum(d, 0)
    return m + tl.log2(total), tl.sum(t, 0) / total


@triton.jit
def _stats_kernel(
    X, x_stride,  # [C, V] logits of this slice, only read
    Y, y_stride,  # [C] int global target indices, ignore_index for a skipped row
    OUT,  # [C, 3] fp32 contiguous, written: lse, z_target (0 when the target is not in this slice), mean z
    vocab_start, ignore_index, inv_temp, to_log2,
    V: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # 64-bit row offsets: C * V may pass 2^31
    X += row * x_stride
    OUT += row * 3
    y = tl.load(Y + row * y_stride)
    if y == ignore_index:
        tl.store(OUT, 0.0)
        tl.store(OUT + 1, 0.0)
        tl.store(OUT + 2, 0.0)
        return
    column = y - vocab_start
    z_y = tl.load(X + column, mask=(column >= 0) & (column < V), other=0.0).to(tl.float32) * inv_temp
    lse2, mean = logprobs_row_stats(X, tl.arange(0, BLOCK), inv_temp, to_log2, V, BLOCK, NUM_STAGES)
    tl.store(OUT, lse2 * LN2)
    tl.store(OUT + 1, z_y)
    tl.store(OUT + 2, mean)


@triton.jit
def _grad_kernel(
    X, x_stride,  # [C, V] logits of this slice, overwritten by the gradient
    Y, y_stride,  # [C] int global target indices, ignore_index for a skipped row
    STATS, stats_stride, stats_col_stride,  # [C, 3] global lse, z_target, mean z (fp32 or wider)
    G, g_stride,  # [C] fp32 upstream gradient of the log-probs; unread without HAS_G
    H, h_stride,  # [C] fp32 upstream gradient of the entropy; unread without HAS_H
    vocab_start, ignore_index, inv_temp, to_log2,
    V: tl.constexpr, HAS_G: tl.constexpr, HAS_H: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * x_stride
    y = tl.load(Y + row * y_stride)
    if y == ignore_index:
        zero_cols(X, V, BLOCK)
        return
    if not HAS_G and not HAS_H:  # nothing upstream: the gradient is 0
        zero_cols(X, V, BLOCK)
        return
    STATS += row * stats_stride
    lse2 = tl.load(STATS).to(tl.float32) * LOG2E
    mean = tl.load(STATS + 2 * stats_col_stride).to(tl.float32)
    if HAS_G:
        g = tl.load(G + row * g_stride).to(tl.float32) * inv_temp
    else:
        g = 0.0
    if HAS_H:
        h = tl.load(H + row * h_stride).to(tl.float32) * inv_temp
    y_col = (y - vocab_start).to(tl.int32)  # outside [0, V): the target is another slice's
    cols = tl.arange(0, BLOCK)
    for start in tl.range(0, V, BLOCK, num_stages=NUM_STAGES):
        x, mask = load_block(X, start, cols, V, "evict_first")
        p = tl.exp2(x * to_log2 - lse2)
        if HAS_H:
            w = g + h * (x * inv_temp - mean)
        else:
            w = g
        dz = tl.where(start + cols == y_col, g, 0.0) - p * w
        tl.store(X + start + cols, dz.to(X.dtype.element_ty), mask=mask)


def _launch(n_cols, logits):
    return row_launch(max(n_cols, 1), logits, knobs=LAUNCH.current)


@register_backend("logprobs_stats", backend="triton", priority=PRIORITY, capability=CAPABILITY)
def logprobs_stats(logits, target, *, vocab_start=0, temperature=1.0, ignore_index=-100):
    """[C, 3] fp32 per row of this slice: (lse, z_target where this slice holds the target else 0, mean z)."""
    stats, C, V = row_stats(logits, 3, target, ignore_index, lse_columns=(0,))
    if C and V:
        inv_temp = 1.0 / float(temperature)
        _stats_kernel[(C,)](
            logits, logits.stride(0), target, target.stride(0), stats, int(vocab_start), int(ignore_index),
            inv_temp, LOG2E.value * inv_temp, V=V, **_launch(V, logits),
        )
    return stats


@register_backend("logprobs_grad", backend="triton", priority=PRIORITY, capability=CAPABILITY)
def logprobs_grad(logits, target, stats, grad_logprobs=None, grad_entropy=None, *, vocab_start=0, temperature=1.0,
                  ignore_index=-100):
    """Overwrites this slice's logits with d(sum g logprobs + h entropy)/d logits under the global stats [C, 3]."""
    C, V = logits.shape
    if C == 0 or V == 0:
        return
    g, h = grad_logprobs, grad_entropy
    inv_temp = 1.0 / float(temperature)
    _grad_kernel[(C,)](
        logits, logits.stride(0), target, target.stride(0), stats, stats.stride(0), stats.stride(1),
        stats if g is None else g, 0 if g is None else g.stride(0),
        stats if h is None else h, 0 if h is None else h.stride(0),
        int(vocab_start), int(ignore_index), inv_temp, LOG2E.value * inv_temp,
        V=V, HAS_G=g is not None, HAS_H=h is not None, **_launch(V, logits),
    )
