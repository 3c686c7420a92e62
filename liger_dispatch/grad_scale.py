"""The backward of a loss whose gradients were computed in the forward pass: scale them by the incoming grad_loss.

grad_loss is almost always 1 (loss.backward()), and a scale of a [V, H] weight gradient costs a full read and
write of it (~0.5 ms at a 128k x 4k head), while testing grad_loss == 1 on the host is a device sync. So the scale
is a torch op, `liger_dispatch::scale_`, whose CUDA kernel reads grad_loss on the device and returns at once when
it is 1: a launch, no memory traffic, no sync. It scales in place: the saved gradients are the op's outputs, and
a second backward through the same node (retain_graph=True) is refused rather than scaled twice.

That is the eager path. A backward traced by torch.compile may not change what its forward saved, so the
torch.library ops of the losses scale out of place there (torch_ops._define_loss).
"""

from __future__ import annotations

import functools

import torch

_LIB = torch.library.Library("liger_dispatch", "FRAGMENT")
_LIB.define("scale_(Tensor(a!) grad, Tensor grad_loss) -> ()")


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_kernel(X, G, n, BLOCK: tl.constexpr):  # X: [n] gradient, scaled in place; G: [] grad_loss
        g = tl.load(G).to(tl.float32)
        if g != 1.0:
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(X + offs, mask=mask)
            tl.store(X + offs, (x.to(tl.float32) * g).to(X.dtype.element_ty), mask=mask)

    return scale_kernel


# One block a program: when grad_loss is 1 each program reads it and returns (~n / BLOCK tiny programs, tens of us
# for a 128k x 4k dW), which is the case this kernel exists for.
_BLOCK = 8192


def _scale_cuda(grad: torch.Tensor, grad_loss: torch.Tensor) -> None:
    n = grad.numel()
    if n:
        _kernel()[(-(-n // _BLOCK),)](grad, grad_loss, n, BLOCK=_BLOCK, num_warps=8)


def _scale_cpu(grad: torch.Tensor, grad_loss: torch.Tensor) -> None:
    """The product in fp32, rounded once to the gradient's dtype, as the kernel does."""
    grad.copy_(grad.float() * grad_loss.float())


_LIB.impl("scale_", _scale_cuda, "CUDA")
_LIB.impl("scale_", _scale_cpu, "CPU")
torch.library.register_fake("liger_dispatch::scale_", lambda grad, grad_loss: None, lib=_LIB)


def scaled(ctx, grad_loss: torch.Tensor) -> list:
    """ctx's saved gradients (None where not computed) times grad_loss, in place; a second backward raises."""
    if getattr(ctx, "scaled", False):
        raise RuntimeError("liger_dispatch: a fused-linear loss computes its gradients in the forward pass and "
                           "scales them in place in the backward, so it cannot be backpropagated twice "
                           "(retain_graph=True); compute the loss again instead")
    ctx.scaled = True
    grads = ctx.saved_tensors
    for g in grads:
        if g is not None:
            torch.ops.liger_dispatch.scale_(g, grad_loss)
    return list(grads)
