"""Host-side prologue the vocab-parallel wrappers of every backend share."""

from typing import Optional

import torch


def row_stats(logits: torch.Tensor, n_stats: int, labels: Optional[torch.Tensor] = None, ignore_index: int = -100,
              lse_columns: tuple[int, ...] = ()) -> tuple[torch.Tensor, int, int]:
    """The per-row statistics of this rank's [C, Vl] slice, allocated: (fp32 [C, n_stats], C, Vl).

    A slice with no columns has nothing to launch for: its statistics are filled here, -inf in the log-sum-exp
    (and max) columns `lse_columns` of the rows not ignored, 0 elsewhere (no host sync)."""
    C, V = logits.shape
    stats = torch.empty(C, n_stats, dtype=torch.float32, device=logits.device)
    if V == 0:
        stats.zero_()
        if lse_columns:
            empty_lse = torch.full((C,), float("-inf"), device=logits.device)
            if labels is not None:
                empty_lse = torch.where(labels != ignore_index, empty_lse, 0.0)
            stats[:, list(lse_columns)] = empty_lse.unsqueeze(1)
    return stats, C, V
