"""What the reference kernel-level ops share: per-row losses and their gradient through autograd."""

import contextlib

import torch

from liger_dispatch import Capability
from liger_dispatch.registry.checks import FLOAT_DTYPES

from .formulas import compute_dtype

# the reference runs everywhere, on every dtype the checks accept: the spec, and the last fallback
CAPABILITY = Capability(devices=("cpu", "cuda"), dtypes=FLOAT_DTYPES)
PRIORITY = 100


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView)


@contextlib.contextmanager
def autograd_on():
    """Autograd back on: the reference differentiates its formulas with autograd, also when it runs inside a
    torch.library op (torch.ops.liger_dispatch.*), which runs its implementation with the autograd keys excluded."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def rows_and_grad_in_place(logits, rows_fn, grad_scale):
    """Per-row loss of `rows_fn` on a widened copy of logits; logits is overwritten with grad_scale * d loss_i / d logits_i.

    Returns the unscaled per-row loss in fp32 (float64 for float64 logits).
    """
    with autograd_on():
        z = logits.detach().to(compute_dtype(logits), copy=True).requires_grad_()
        rows = rows_fn(z)
        # rows_i depends on row i only, so a vector-Jacobian product with grad_scale scales each row
        scale = torch.ones_like(rows) if grad_scale is None else grad_scale.to(rows.dtype).expand_as(rows)
        (grad,) = torch.autograd.grad(rows, z, grad_outputs=scale)
    with torch.no_grad():
        logits.copy_(grad)
    return rows.detach()
