"""Vocab-parallel (tensor-parallel) fused-linear losses: each rank of a process group holds a contiguous slice of
the LM head's vocabulary, in rank order (sizes may differ), and the same input rows.

The chunk driver (fused_linear.py) runs unchanged on this rank's slice; only the kernel-level op changes. Per chunk
of C rows, the backend's statistics pass reads the slice's logits; every rank's per-row statistics are all-gathered
([W, C, k] fp32) and combined in the same order on every rank (one collective, not an all-reduce MAX then SUM); the
gradient pass writes the slice's gradient from the global statistics. Every rank computes the same loss, and no
[N, V] buffer exists anywhere. Collectives of one call:

    vocab sizes (process_group= only; a DTensor's split is known)    1 all-gather of W int64, read on the host
    per chunk, the statistics (the op family's layout)               1 all-gather of [C, k] fp32 (and what the
                                                                     family adds: an all-reduce of its row sums)
    input gradient                                                   1 all-reduce SUM of dX [N, H]
    fp16 inputs only: the gradient buffers' scale                     1 all-reduce SUM of a [N] fp32 bound

A loss per row (reduction="none") runs its chunks again in the backward (sizes and statistics again, then dX).

An op family declares its path with a `VocabParallel` (OpSpec.vocab_parallel); `serving` serves a call whose
`process_group` is set. A weight that is a DTensor sharded on dim 0 over a 1-D mesh is `localized` first: the input must
be a DTensor too, the other vocab-sliced tensors DTensors sharded like it; the loss is then a plain tensor and the
weight's gradient a DTensor shard.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from liger_dispatch.core import calls
from liger_dispatch.errors import InputError
from liger_dispatch.core.schema import Args
from liger_dispatch.core.table import TABLE


@dataclass(frozen=True)
class VocabParallel:
    """How an op family's user-level loss runs with its vocabulary split over a process group.

    weight: the argument that is this rank's slice. sliced: the tensors split like the vocabulary, name -> dim.
    replicated: the tensors every rank holds whole, name -> whether a plain tensor is accepted beside a DTensor
    weight (not for the input: a sharded FSDP parameter read outside its forward is refused, not taken for a slice).
    kernel(shard, kernels): the composition's kernel-level op over this rank's slice, where
    kernels(op, *args, **kwargs) runs a vocab-parallel kernel-level op of the selected backend."""

    weight: str
    sliced: dict
    replicated: dict
    kernel: Callable


# all_gather_into_tensor was renamed all_gather_single in torch 2.13; the GPU image has 2.11
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def serving(spec, impl, a: Args, pinned: tuple[str, ...]) -> Callable:
    """What serves a call of a user-level loss: impl.fn, or, when the call has a process_group, the vocab-parallel
    driver (the composition's signature and return contract) on the vocab-parallel kernels of impl's backend when
    the handle pinned it, else of the backend selection picks for them (use_backend and LIGER_BACKEND hold)."""
    if getattr(a, "process_group", None) is None:
        return impl.fn
    return (_DriverWithBackward if spec.saved else _Driver)(spec, _Kernels(impl.backend if pinned else None))


def localized(spec, a: Args, args: tuple, kwargs: dict) -> tuple[Args, tuple, dict]:
    """A call whose weight is a DTensor sharded on the vocabulary as the same call on this rank's local tensors, with
    process_group the shard; any other call as it is."""
    declared, types = spec.vocab_parallel, _dtensor_types()
    weight = getattr(a, declared.weight)
    if types is None or not isinstance(weight, types[0]):
        return a, args, kwargs
    layout = _DTensorLayout(weight, a.process_group)
    values = {**a.__dict__, "process_group": layout.shard}
    values.update({name: layout.sliced(name, values[name], dim) for name, dim in declared.sliced.items()})
    values.update({name: layout.replicated(name, values[name], ok) for name, ok in declared.replicated.items()})
    local = Args(values)
    return (local, *spec.schema.call_args(local))


def resolve_group(process_group):
    """A ProcessGroup from a ProcessGroup or its group name."""
    if isinstance(process_group, str):
        return dist.distributed_c10d._resolve_process_group(process_group)
    return process_group


def group_name(process_group) -> str:
    """What the torch op takes: the group's name (a ProcessGroup, or a name already)."""
    if isinstance(process_group, VocabShard):
        raise InputError("a DTensor weight takes the vocab-parallel path in eager mode only; under torch.compile pass "
                         "its local tensors (to_local()) with process_group=")
    return process_group if isinstance(process_group, str) else process_group.group_name


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice [start, start + size) of a vocabulary of `total` columns split over `group`; `widest`, the
    largest slice, sizes every rank's chunks, so that all ranks make the same collectives."""

    group: Any
    start: int
    size: int
    total: int
    widest: int

    @classmethod
    def from_sizes(cls, group, sizes: list[int]) -> "VocabShard":
        rank = dist.get_rank(group)
        return cls(group, sum(sizes[:rank]), sizes[rank], sum(sizes), max(sizes))

    @classmethod
    def of(cls, process_group, weight: torch.Tensor) -> "VocabShard":
        """The call's shard: `localized`'s, or one from its ranks' slice sizes (one all-gather, one host read)."""
        if isinstance(process_group, VocabShard):
            return process_group
        group, device = resolve_group(process_group), weight.device
        sizes = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
        _all_gather(sizes, torch.tensor([weight.shape[0]], dtype=torch.int64, device=device), group=group)
        return cls.from_sizes(group, sizes.tolist())

    def combine(self, stats: torch.Tensor, lse_columns: int, max_columns: int = 0) -> torch.Tensor:
        """The global [C, k] statistics from this rank's [C, k]: all-gathered, then combined."""
        return combine(self.gather(stats), lse_columns, max_columns)

    def gather(self, stats: torch.Tensor) -> torch.Tensor:
        """Every rank's [C, k] statistics as [W, C, k], in rank order (one all-gather)."""
        world = dist.get_world_size(self.group)
        gathered = stats.new_empty((world * stats.shape[0], *stats.shape[1:]))  # gloo takes the concatenated form
        _all_gather(gathered, stats.contiguous(), group=self.group)
        return gathered.view(world, *stats.shape)

    def sum_over_ranks(self, t: torch.Tensor) -> None:
        """t <- its sum over the ranks, in place (t contiguous)."""
        dist.all_reduce(t, group=self.group)

    def bound_over_ranks(self, row_bound: Callable, x: torch.Tensor, vocab: int) -> torch.Tensor:
        """A bound of each row's gradient L1 norm on every slice (fp16 buffers, grad_bounds.py): the sum over the
        ranks of each slice's own bound ([N] fp32, one all-reduce). One slice's bound need not hold for the others
        (its lse bound misses their logits, its KL mass their target mass); the sum does: a KL gradient's L1 norm on
        a slice is at most (total mass + slice mass) / T, and the log-softmax bounds grow with each slice's logit
        bound and log of its width, whose sums exceed their max and log of the total width (slices of 2+ columns)."""
        local = row_bound() if vocab else 0.0
        total = torch.as_tensor(local, dtype=torch.float32, device=x.device).broadcast_to(x.shape[:1]).contiguous()
        self.sum_over_ranks(total)
        return total


def combine(gathered: torch.Tensor, lse_columns: int, max_columns: int = 0) -> torch.Tensor:
    """Global per-row statistics from every rank's [W, C, k]: log-sum-exp over the ranks of the first `lse_columns`
    columns, max of the next `max_columns`, sum of the others; the same arithmetic in the same order on every rank."""
    total = gathered.sum(0)
    total[:, :lse_columns] = torch.logsumexp(gathered[:, :, :lse_columns], dim=0)
    maxima = slice(lse_columns, lse_columns + max_columns)
    total[:, maxima] = gathered[:, :, maxima].amax(dim=0)
    return total


class _Kernels:
    """The vocab-parallel kernel-level ops of one call: `backend`'s where it implements one, else the one selection
    picks (it warns only if that is the reference while a better backend exists); each op selected once a call."""

    def __init__(self, backend: Optional[str]):
        self.backend = backend
        self._fns: dict[str, Callable] = {}

    def __call__(self, op: str, *args, **kwargs):
        fn = self._fns.get(op)
        if fn is None:
            implements = any(impl.backend == self.backend for impl in TABLE.candidates(op))
            pinned = (self.backend,) if implements else ()
            fn = self._fns[op] = calls.kernel(TABLE.spec(op), pinned, args, kwargs)
        return fn(*args, **kwargs)


def _dtensor_types():
    """(DTensor, Replicate, Shard), or None while torch.distributed.tensor is not imported (then no DTensor exists).
    Another thread may be importing it: a module still without DTensor holds no DTensor yet either."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return None if dtensor is None else (dtensor, module.Replicate, module.Shard)


class _DTensorLayout:
    """Where a call's tensors sit when its weight is a DTensor sharded on the vocabulary over a 1-D mesh."""

    def __init__(self, weight: torch.Tensor, process_group):
        self.mesh = mesh = weight.device_mesh
        if mesh.ndim != 1:
            raise InputError(f"weight is a DTensor on a {mesh.ndim}-D mesh; the vocab-parallel path needs a 1-D mesh "
                             "(pass the tensor-parallel submesh's DTensor, or to_local() slices with process_group=)")
        if process_group is not None and resolve_group(process_group) is not mesh.get_group():
            raise InputError("process_group is not the group of the weight's DeviceMesh; pass one of them")
        vocab, world = weight.shape[0], mesh.size()
        step = -(-vocab // world)  # Shard(0) splits as torch.chunk does
        sizes = [max(0, min(step, vocab - r * step)) for r in range(world)]
        self.shard = VocabShard.from_sizes(mesh.get_group(), sizes)

    def sliced(self, name: str, t, dim: int):
        """This rank's slice of a tensor split along `dim` like the vocabulary (a DTensor's local shard)."""
        if t is None:
            return t
        dtensor, _, shard = _dtensor_types()
        if not isinstance(t, dtensor) or t.device_mesh != self.mesh or tuple(t.placements) != (shard(dim % t.dim()),):
            raise InputError(f"{name} must be a DTensor sharded on dim {dim} over the weight's mesh, like the weight")
        local = t.to_local()
        if local.shape[dim] != self.shard.size:
            raise InputError(f"{name} holds {local.shape[dim]} columns of the vocabulary on this rank, expected "
                             f"{self.shard.size} (the split of torch.chunk)")
        return local

    def replicated(self, name: str, t, plain_ok: bool):
        """A tensor every rank holds whole: a DTensor is redistributed to Replicate and its local tensor taken."""
        dtensor, replicate, _ = _dtensor_types()
        if isinstance(t, dtensor):
            return t.redistribute(self.mesh, [replicate()]).to_local()
        if t is None or plain_ok:
            return t
        raise InputError(f"{name} must be a DTensor on the weight's mesh (it is redistributed to Replicate) when the "
                         "weight is a DTensor; a sharded FSDP parameter read outside its module's forward lands here "
                         "too: read the weight inside the forward (liger_dispatch.nn.LMHeadLoss)")


class _Driver:
    """A user-level loss over this rank's slice: the op's composition of the family's kernel(s) for the slice."""

    def __init__(self, spec, kernels: _Kernels):
        self.spec, self.kernels = spec, kernels

    def __call__(self, *args, process_group, **options):
        return self._composed(process_group, args, options)(*args, **options)

    def _composed(self, process_group, args: tuple, options: dict):
        """VocabParallel.kernel may give several kernels: one per op of composed_of."""
        weight = args[1] if len(args) > 1 else options[self.spec.vocab_parallel.weight]
        shard = VocabShard.of(process_group, weight)
        fns = self.spec.vocab_parallel.kernel(shard, self.kernels)
        return self.spec.compose(*(fns if isinstance(fns, tuple) else (fns,)), shard)


class _DriverWithBackward(_Driver):
    """An op with a backward (OpSpec.saved), which makes the composition again (the slice sizes exchanged again)."""

    def backward(self, *args, process_group, **options):
        return self._composed(process_group, args, options).backward(*args, **options)
