"""Host-side prologue the vocab-parallel wrappers of every backend share (issue 11)."""

from typing import Optional

import torch


def row_stats(logits: torch.Tensor, n_stats: int) -> tuple[torch.Tensor, int, int]:
    """The per-row statistics of this rank's [C, Vl] slice, allocated: (fp32 [C, n_stats], C, Vl)."""
    C, V = logits.shape
    return torch.empty(C, n_stats, dtype=torch.float32, device=logits.device), C, V


def empty_slice_stats(stats: torch.Tensor, labels: Optional[torch.Tensor], ignore_index: int,
                      lse_columns: tuple[int, ...]) -> torch.Tensor:
    """stats of a slice with no columns: -inf in the log-sum-exp columns of the rows not ignored, else 0.

    No kernel runs (nothing to read) and nothing syncs with the host."""
    stats.zero_()
    if labels is None:
        stats[:, list(lse_columns)] = float("-inf")
    else:
        empty_lse = torch.where(labels != ignore_index, float("-inf"), 0.0).to(stats.dtype)
        stats[:, list(lse_columns)] = empty_lse.unsqueeze(1)
    return stats
