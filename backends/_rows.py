"""Host-side prologue the loss wrappers of every backend share."""

import torch


def row_losses(logits: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The per-row loss of [C, V] logits, allocated: (fp32 [C] on their device, C, V).

    The inputs' shapes and layouts are the registry's checks (registry/heads.py) on every dispatched call;
    the fused-linear compositions pass buffers they made 2-D with a contiguous last dim.
    """
    C, V = logits.shape
    return torch.empty(C, dtype=torch.float32, device=logits.device), C, V
