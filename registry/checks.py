"""Input validation shared by the op specs: each failure names the argument and what was expected."""

from __future__ import annotations

import math
from typing import Optional

import torch

from liger_dispatch.errors import InputError
from liger_dispatch import settings

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def tensor(name: str, value, *, ndim: Optional[int] = None, min_ndim: int = 0, floating: bool = False,
           integer: bool = False) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise InputError(f"{name} is a {value.layout} tensor; the ops take dense (strided) tensors: pass "
                         f"{name}.to_dense()")
    if ndim is not None and value.dim() != ndim:
        raise InputError(f"{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if value.dim() < min_ndim:
        raise InputError(f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(value.shape)}")
    if floating and value.dtype not in FLOAT_DTYPES:
        raise InputError(f"{name} must be bfloat16, float16 or float32, got {value.dtype}")
    if integer and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        raise InputError(f"{name} must be an integer tensor (int64), got {value.dtype}")
    return value


def same_device(**tensors) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    for name, value in items:
        tensor(name, value)
    first_name, first = items[0]
    for name, value in items[1:]:
        if value.device != first.device:
            raise InputError(f"{name} is on {value.device} but {first_name} is on {first.device}")


def same_dtype(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise InputError(f"{b_name} has dtype {b.dtype} but {a_name} has {a.dtype}; they must match")


def dim_equals(name: str, actual: int, expected: int, what: str, expected_from: str = "") -> None:
    """`name`'s `what` is `actual`; it must be `expected`, taken from `expected_from` (another argument) if given."""
    if actual != expected:
        origin = f" ({expected_from})" if expected_from else ""
        raise InputError(f"{name}: {what} is {actual}, expected {expected}{origin}")


def rows(name: str, count: int, n: int, what: str = "number of rows") -> None:
    if count != n:
        raise InputError(f"{name}: {what} is {count} but the input has {n} rows")


def leading_shape(name: str, shape: torch.Size, input_name: str, input: torch.Tensor, what: str = "shape") -> None:
    """One entry of `name` per row of `input` [..., H]: `shape` is input's leading shape, or that flattened to [N].

    As torch's cross-entropy sees it: F.cross_entropy on [B, T, V] logits flattened to [B*T, V] takes a target of
    [B*T]; a target of the input's own leading shape [B, T] is the same rows in the same order. Any other shape
    of the same element count ([2, 4] for 8 rows) pairs rows by accident, so it is an error, as it is in torch.
    """
    lead = input.shape[:-1]
    n = lead.numel()
    if tuple(shape) == tuple(lead) or tuple(shape) == (n,):
        return
    expected = f"{list(lead)}" + ("" if len(lead) == 1 else f" or {[n]}")
    raise InputError(f"{name}: {what} is {list(shape)}, expected {expected} ({input_name} has shape "
                     f"{list(input.shape)}: one entry per row of [..., H])")


def choice(name: str, value, options: tuple) -> None:
    if value not in options:
        raise InputError(f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}")


def _number(value) -> bool:
    """A finite int or float; a bool is not a number here (label_smoothing=True is a mistake, not 1.0). Compared, not
    math.isfinite: torch.compile makes a float that changes between calls symbolic, and compares it (a guard)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and -math.inf < value < math.inf


def in_range(name: str, value, low: float, high: float) -> None:
    if not _number(value) or not (low <= value <= high):
        raise InputError(f"{name} must be a number in [{low}, {high}], got {value!r}")


def positive(name: str, value) -> None:
    if not _number(value) or not value > 0:
        raise InputError(f"{name} must be > 0 and finite, got {value!r}")


def non_negative(name: str, value) -> None:
    if not _number(value) or not value >= 0:
        raise InputError(f"{name} must be >= 0 and finite, got {value!r}")


def boolean(name: str, value) -> None:
    if not isinstance(value, bool):
        raise InputError(f"{name} must be True or False, got {value!r}")


def integer(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an int, got {value!r}")


_support = None  # registry/support.py, once class_indices first needs it


def class_indices(name: str, target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every entry in [0, vocab) or equal to ignore_index.

    On an accelerator the check is a device-side assert (as torch's own cross-entropy does it): no host sync, a
    bad label stops the device with a message (registry/support.py). LIGER_CHECKS=full checks on the host instead,
    with a Python error.
    """
    if target.numel() == 0:
        return
    if target.device.type != "cpu" and settings.CHECKS.get() != "full":
        global _support
        if _support is None:  # imported here, once: support's checks use this module
            from liger_dispatch.registry import support as _support
        _support.run("check_class_indices", target, vocab=vocab, ignore_index=ignore_index, name=name)
        return
    low, high = (int(v) for v in torch.stack(torch.aminmax(torch.where(target == ignore_index, 0, target))).tolist())
    if low < 0 or high >= vocab:
        value = low if low < 0 else high
        raise InputError(f"{name} holds {value}, outside [0, {vocab}) and not ignore_index ({ignore_index})")


def grad_scale(value, n_rows: int) -> None:
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise InputError(f"grad_scale must be a float32 tensor of shape [] or [{n_rows}], got "
                         f"{type(value).__name__} {value!r} (a number: torch.tensor({value!r}))")
    tensor("grad_scale", value)
    if value.dtype != torch.float32 or not (value.dim() == 0 or tuple(value.shape) == (n_rows,)):
        raise InputError(f"grad_scale must be a float32 tensor of shape [] or [{n_rows}], "
                         f"got {value.dtype} {tuple(value.shape)}")


def last_dim_contiguous(name: str, value: torch.Tensor) -> None:
    if value.dim() > 0 and value.shape[-1] > 1 and value.stride(-1) != 1:
        raise InputError(f"{name} must have a contiguous last dimension (stride 1), got strides {value.stride()}")


def probabilities(name: str, target: torch.Tensor, log_target: bool) -> None:
    """A KL target of probabilities has no negative entry (LIGER_CHECKS=full host check; one aminmax, one sync).

    Without it a negative probability makes its row's loss NaN, as torch's kl_div does (benchmarks/kl_semantics.md);
    log-targets (log_target=True) are any real numbers and are not checked. NaN entries are not caught here.
    """
    if log_target or target.numel() == 0:
        return
    low = float(torch.aminmax(target).min)
    if low < 0:
        raise InputError(f"{name} holds {low}, a negative probability (log-probabilities need log_target=True)")
