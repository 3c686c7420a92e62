"""check_class_indices, scale_grad and valid_rows in Triton (registry/support.py): one launch each, no host sync,
launched directly after a signature's first call (_support.Launch: ~1 us of Python, not Triton's ~15). On CUDA
devices only: under the interpreter the reference's torch ops serve CPU tensors faster."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from liger_dispatch import register_backend

from .._host import BoundedCache
from ._support import CAPABILITY, PRIORITY, Launch, direct_target

CUDA_ONLY = dataclasses.replace(CAPABILITY, devices=("cuda",), dtypes=None)
LABEL_BLOCK = 1024
# When grad_loss is 1 (the case this kernel exists for) each program reads it and returns, so the grid is at most
# SCALE_PROGRAMS programs that stride over the blocks: one program a block took ~21 us to retire the 64k programs of
# a 128k x 4k dW (H200).
SCALE_BLOCK = 8192
SCALE_PROGRAMS = 1024
# valid_rows: one program counts every label, a block a step (a mean's divisor for up to 2^24 rows is exact in fp32)
ROWS_BLOCK = 8192
_launches = BoundedCache("triton support launches", 1024)  # one per kernel and call signature


@triton.jit(debug=True)  # tl.device_assert is compiled in only in debug mode
def _check_kernel(
    T,  # [n] labels
    n, vocab, ignore_index, MESSAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(T + offs, mask=offs < n, other=0).to(tl.int64)
    tl.device_assert((t == ignore_index) | ((t >= 0) & (t < vocab)), MESSAGE)


@triton.jit
def _scale_kernel(
    X,  # [n] gradient, scaled in place
    G,  # [] grad_loss
    n, STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    g = tl.load(G).to(tl.float32)
    if g != 1.0:
        for step in range(STEPS):  # program p takes blocks p, p + programs, ...
            block = tl.program_id(0) + step * tl.num_programs(0)
            offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(X + offs, mask=mask)
            tl.store(X + offs, (x.to(tl.float32) * g).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rows_kernel(
    T,  # [n] labels
    L,  # [n] fp32 losses; unread without HAS_LOSSES
    OUT,  # [2] fp32: count (at least 1), scale / count; [3] with HAS_LOSSES: then sum(L) * scale / count
    n, ignore_index, scale, HAS_LOSSES: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    counts = tl.zeros([BLOCK], dtype=tl.int32)
    sums = tl.zeros([BLOCK], dtype=tl.float32)
    for step in range(STEPS):  # a constexpr trip count: the interpreter takes no runtime loop bound
        offs = step * BLOCK + tl.arange(0, BLOCK)
        in_rows = offs < n
        t = tl.load(T + offs, mask=in_rows, other=0)
        counts += ((t != ignore_index) & in_rows).to(tl.int32)
        if HAS_LOSSES:
            sums += tl.load(L + offs, mask=in_rows, other=0.0)
    count = tl.maximum(tl.sum(counts, axis=0).to(tl.float32), 1.0)
    inverse = tl.div_rn(scale, count)  # IEEE division, as torch's (Triton's `/` is approximate)
    tl.store(OUT, count)
    tl.store(OUT + 1, inverse)
    if HAS_LOSSES:
        tl.store(OUT + 2, tl.sum(sums, axis=0) * inverse)


def launch_check(target, vocab, ignore_index, name="target"):
    """The check of a 1-D contiguous target (the interpreter runs it on CPU tensors: the tests)."""
    n = target.numel()
    if n:
        def plan():
            message = f"{name} holds a class index outside [0, V) that is not ignore_index; LIGER_CHECKS=full names it"
            return Launch(_check_kernel, (triton.cdiv(n, LABEL_BLOCK),), (n, vocab, ignore_index), num_warps=4,
                          MESSAGE=message, BLOCK=LABEL_BLOCK)

        _launches.get((_check_kernel, n, vocab, ignore_index, name, target.dtype), plan)(direct_target(target), target)


def launch_scale(grad, grad_loss):
    n = grad.numel()
    if n:
        def plan():
            blocks = triton.cdiv(n, SCALE_BLOCK)
            programs = min(blocks, SCALE_PROGRAMS)
            return Launch(_scale_kernel, (programs,), (n,), num_warps=8, STEPS=triton.cdiv(blocks, programs),
                          BLOCK=SCALE_BLOCK)

        key = (_scale_kernel, n, grad.dtype, grad_loss.dtype)
        _launches.get(key, plan)(direct_target(grad, grad_loss), grad, grad_loss)


def launch_rows(target, ignore_index, scale, losses=None):
    """valid_rows of a 1-D contiguous target and losses (the interpreter runs it on CPU tensors: the tests)."""
    n = target.numel()
    has_losses = losses is not None
    out = torch.empty(3 if has_losses else 2, dtype=torch.float32, device=target.device)
    losses = losses if has_losses else out  # a pointer the kernel does not read

    def plan():
        steps = max(triton.cdiv(n, ROWS_BLOCK), 1)
        return Launch(_rows_kernel, (1,), (n, ignore_index, scale), num_warps=8, HAS_LOSSES=has_losses, STEPS=steps,
                      BLOCK=ROWS_BLOCK)

    key = (_rows_kernel, n, ignore_index, scale, target.dtype, has_losses)
    _launches.get(key, plan)(direct_target(target, losses, out), target, losses, out)
    return out


def _flat(target):
    """target as a 1-D contiguous tensor (itself when it is one: the per-call path). contiguous: a strided view (a
    column of a label matrix) flattens to a strided view, which the kernels would read as contiguous memory."""
    if target.dim() == 1 and target.is_contiguous():
        return target
    return target.reshape(-1).contiguous()


@register_backend("check_class_indices", backend="triton", priority=PRIORITY, capability=CUDA_ONLY)
def check_class_indices(target, *, vocab, ignore_index, name="target"):
    launch_check(_flat(target), vocab, ignore_index, name)


@register_backend("scale_grad", backend="triton", priority=PRIORITY, capability=CUDA_ONLY)
def scale_grad(grad, grad_loss):
    launch_scale(grad, grad_loss)


@register_backend("valid_rows", backend="triton", priority=PRIORITY, capability=CUDA_ONLY)
def valid_rows(target, *, ignore_index, scale=1.0, losses=None):
    return launch_rows(_flat(target), ignore_index, float(scale), None if losses is None else _flat(losses))
