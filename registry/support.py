"""Kernel-level ops the machinery itself runs on the device, with a torch fallback in the reference backend:

    check_class_indices(target, vocab, ignore_index): a device-side assert that every label is ignore_index or in
        [0, vocab), as torch's own cross-entropy checks (no host sync: a bad label stops the device with a message)
    scale_grad(grad, grad_loss): the backward of a loss whose gradients were computed in the forward pass scales
        them in place by grad_loss (almost always 1: the kernel reads it on the device and returns at once then)
    valid_rows(target, ignore_index, scale, losses): [count, scale / count] in fp32, count the rows whose target is
        not ignore_index, at least 1 (all rows ignored: a mean of 0, not NaN): a mean's divisor and gradient scale in
        one launch, where torch takes four (ne, sum, clamp_min, division); given the rows' losses (fp32 [n]), a third
        entry, their sum times scale / count: a mean loss computed after its rows (no gradient to scale) in the same
        launch

They are not the user's to pin: selection takes the best backend that serves the device, whatever LIGER_BACKEND
says (OpSpec.internal).
"""

from __future__ import annotations

import torch

from liger_dispatch.core import calls
from liger_dispatch.core.table import TABLE, OpSpec
from liger_dispatch.registry import checks as c

LABELS_SCHEMA = "check_class_indices(Tensor target, *, int vocab, int ignore_index, str name='target') -> ()"
SCALE_SCHEMA = "scale_grad(Tensor(a!) grad, Tensor grad_loss) -> ()"
ROWS_SCHEMA = "valid_rows(Tensor target, *, int ignore_index, float scale=1.0, Tensor? losses=None) -> Tensor"



def run(op: str, *args, **kwargs):
    """op's selected implementation on these arguments, and what it returns (within a plan's value checks, selected
    once per signature of that plan: calls.machinery)."""
    return calls.machinery(TABLE.spec(op), args, kwargs)


def check_labels(a):
    c.tensor("target", a.target, integer=True)
    c.integer("vocab", a.vocab)
    c.integer("ignore_index", a.ignore_index)


def check_scale(a):
    c.tensor("grad", a.grad, floating=True)
    if not a.grad.is_contiguous():
        raise c.InputError("grad must be contiguous (the gradients a loss computes in its forward pass are)")
    c.tensor("grad_loss", a.grad_loss)
    c.same_device(grad=a.grad, grad_loss=a.grad_loss)


def check_rows(a):
    c.tensor("target", a.target, integer=True)
    c.integer("ignore_index", a.ignore_index)
    c.positive("scale", a.scale)
    if a.losses is not None:
        c.tensor("losses", a.losses, ndim=1)
        if a.losses.dtype != torch.float32:
            raise c.InputError(f"losses must be float32 (a loss kernel's rows), got {a.losses.dtype}")
        c.rows("losses", a.losses.numel(), a.target.numel(), "length")
        c.same_device(target=a.target, losses=a.losses)


def _nothing(a):
    return None


def _count_and_scale(a):
    return a.target.new_empty(2 if a.losses is None else 3, dtype=torch.float32)


OPS = (
    OpSpec(LABELS_SCHEMA, "kernel", check_labels, fake=_nothing, internal=True,
           summary="device-side assert: every label is ignore_index or in [0, vocab)"),
    OpSpec(SCALE_SCHEMA, "kernel", check_scale, fake=_nothing, internal=True,
           summary="in-place scale of a gradient by grad_loss (a no-op read when it is 1)"),
    OpSpec(ROWS_SCHEMA, "kernel", check_rows, fake=_count_and_scale, internal=True,
           summary="[count, scale / count(, scale * mean loss)] of the rows not ignored (count at least 1), in one launch"),
)
BACKEND_MODULES = {"check_class_indices": "support", "scale_grad": "support", "valid_rows": "support"}
BACKENDS = ("reference", "triton")  # the backends with a support module
