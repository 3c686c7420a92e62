"""Host-side prologue the loss wrappers of every backend share."""

import torch


def row_losses(**rows: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Check each named [C, V] input (2-D, unit column stride) and allocate the per-row loss.

    Returns (loss, C, V): an fp32 [C] tensor on the device of the first input, and that input's shape.
    Names are given as keywords so an error names the offending argument.
    """
    for name, x in rows.items():
        if x.dim() != 2 or (x.stride(1) != 1 and x.shape[1] > 1):
            raise ValueError(f"{name} must be 2-D with a contiguous last dim, got shape {tuple(x.shape)} "
                             f"strides {x.stride()}")
    first = next(iter(rows.values()))
    C, V = first.shape
    return torch.empty(C, dtype=torch.float32, device=first.device), C, V
