"""Per-token log-probs and entropy (registry/logprobs.py) as Helion kernels: one row a program, one pass over the row
per kernel, as the row kernels of ce.py / vocab_parallel.py.

    logprobs_stats: an online softmax in base 2 (running max per row, per-lane sums of exp2 and of exp2 * z,
        rescaled as the max moves, reduced once at the end) and the target's logit where this slice holds it
        -> (lse, z_target, mean z).
    logprobs_grad:  dz_j = (g (1[j = target] - p_j) - h p_j (z_j - mean)) / T from the global statistics, written
        over the logits; a None upstream gradient is a specialization: not read, its term not computed.

Both passes load evict-first: the gradient pass runs in the backward, long after the statistics pass read the row.
Ignored rows are never read: zero statistics, zero gradient.
"""

from typing import Optional

import torch
import helion.language as hl

from liger_dispatch import register_backend

from .._vp_rows import row_stats
from ._support import (
    CAPABILITY, LN2, LOG2E, PRIORITY, STREAM, Kernel, bucket, exp2, flat_rows, load_f32, log2, needs_int64,
    online_softmax_step, row_config,
)


def _logprobs_stats(
    logits: torch.Tensor,  # [C, Vl] this slice's logits, only read
    logits_flat: torch.Tensor,  # logits' storage as 1-D, for the target gather
    row_stride: int,
    target: torch.Tensor,  # [C] global target indices
    stats: torch.Tensor,  # [C, 3] fp32 out: lse, z_target (0 unless this slice holds it), mean z
    vocab_start: int,
    ignore_index: int,
    inv_temp: float,  # 1 / T
) -> None:
    C, V = logits.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        y = target[tile_c].to(torch.int32)
        valid = y != ignore_index
        local = y - vocab_start
        owned = valid & (local >= 0) & (local < V)
        z_y = hl.load(logits_flat, [tile_c.index * row_stride + torch.where(owned, local, 0)]).to(torch.float32)
        row_mask = valid[:, None]  # ignored rows are never read
        m = hl.full([tile_c], float("-inf"), dtype=torch.float32)
        d = hl.zeros([tile_c, block_v], dtype=torch.float32)  # per-lane sum of exp2(u - m)
        t = hl.zeros([tile_c, block_v], dtype=torch.float32)  # per-lane sum of exp2(u - m) * z
        for tile_v in hl.tile(V, block_size=block_v):
            z = load_f32(logits, tile_c, tile_v, row_mask, STREAM) * inv_temp
            m, alpha, e = online_softmax_step(m, z * LOG2E, tile_v.index[None, :] < V)
            d = d * alpha + e
            t = t * alpha + e * z  # e is 0 past the row end
        total = torch.sum(d, dim=1)
        stats[tile_c, 0] = torch.where(valid, (m + log2(total)) * LN2, 0.0)
        stats[tile_c, 1] = torch.where(owned, z_y * inv_temp, 0.0)
        stats[tile_c, 2] = torch.where(valid, torch.sum(t, dim=1) / total, 0.0)


def _logprobs_grad(
    logits: torch.Tensor,  # [C, Vl] this slice's logits, overwritten by the gradient
    target: torch.Tensor,  # [C] global target indices
    stats: torch.Tensor,  # [C, 3] global lse, z_target, mean z
    grad_logprobs: Optional[torch.Tensor],  # [C] fp32 g, or None (0, not read)
    grad_entropy: Optional[torch.Tensor],  # [C] fp32 h, or None (0, not read)
    vocab_start: int,
    ignore_index: int,
    inv_temp: float,  # 1 / T
) -> None:
    C, V = logits.shape
    block_c = hl.register_block_size(C)
    block_v = hl.register_block_size(V)
    for tile_c in hl.tile(C, block_size=block_c):
        y = target[tile_c].to(torch.int32)
        valid = y != ignore_index
        local = y - vocab_start  # outside [0, Vl): the target is another slice's
        row_mask = valid[:, None]
        lse2 = stats[tile_c, 0].to(torch.float32) * LOG2E
        mean = stats[tile_c, 2].to(torch.float32)
        g = hl.zeros([tile_c], dtype=torch.float32)
        if grad_logprobs is not None:
            g = torch.where(valid, grad_logprobs[tile_c].to(torch.float32), 0.0) * inv_temp
        h = hl.zeros([tile_c], dtype=torch.float32)
        if grad_entropy is not None:
            h = torch.where(valid, grad_entropy[tile_c].to(torch.float32), 0.0) * inv_temp
        for tile_v in hl.tile(V, block_size=block_v):
            z = load_f32(logits, tile_c, tile_v, row_mask, STREAM) * inv_temp
            p = exp2(z * LOG2E - lse2[:, None])
            on_target = torch.where(tile_v.index[None, :] == local[:, None], g[:, None], 0.0)
            if grad_entropy is not None:  # a Python `if` on the specialization; one shape for dz in both branches
                dz = on_target - p * (g[:, None] + h[:, None] * (z - mean[:, None]))
            else:
                dz = on_target - p * g[:, None]
            logits[tile_c, tile_v] = torch.where(row_mask, dz, 0.0).to(logits.dtype)


def default_config(v_bucket: int) -> dict:
    """One row a program, blocks of up to 4096 columns, as ce.py (one input a thread)."""
    return row_config(v_bucket, 4096)


STATS = Kernel(_logprobs_stats, "logprobs_stats", default_config)
GRAD = Kernel(_logprobs_grad, "logprobs_grad", default_config)
KERNELS = (STATS, GRAD)


def _launch(logits: torch.Tensor) -> dict:
    return dict(like=logits, shape_key=bucket(logits.shape[1]), int64=needs_int64(logits))


@register_backend("logprobs_stats", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def logprobs_stats(logits, target, *, vocab_start=0, temperature=1.0, ignore_index=-100):
    """[C, 3] fp32 per row of this slice: (lse, z_target where this slice holds the target else 0, mean z)."""
    stats, C, V = row_stats(logits, 3, target, ignore_index, lse_columns=(0,))
    if C and V:
        STATS(logits, flat_rows(logits), logits.stride(0), target, stats, int(vocab_start), int(ignore_index),
              1.0 / float(temperature), **_launch(logits))
    return stats


@register_backend("logprobs_grad", backend="helion", priority=PRIORITY, capability=CAPABILITY)
def logprobs_grad(logits, target, stats, grad_logprobs=None, grad_entropy=None, *, vocab_start=0, temperature=1.0,
                  ignore_index=-100):
    """Overwrites this slice's logits with d(sum g logprobs + h entropy)/d logits under the global stats [C, 3]."""
    C, V = logits.shape
    if C == 0 or V == 0:
        return
    GRAD(logits, target, stats, grad_logprobs, grad_entropy, int(vocab_start), int(ignore_index),
         1.0 / float(temperature), **_launch(logits))
