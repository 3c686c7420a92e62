"""Cross-entropy of an LM head: the user-level `flce` (fused linear + cross-entropy, with label smoothing, softcap
and z-loss) and the kernel-level ops it is composed of, everything the machinery needs to serve them.

    flce(input [..., H], weight [V, H], target [...], bias [V]?) -> loss
    ce_loss_and_grad(logits [C, V], target [C]) -> loss rows [C]; logits overwritten by grad_scale * d loss / d logits
    ce_vp_stats / ce_vp_grad: the same over one rank's vocabulary slice (vocab-parallel)

Per row: (1 - eps)(lse - z_y) + eps (lse - mean_j z_j) + lse_square_scale lse^2, z = input @ weight.T + bias, with
softcap s: z = s tanh(z / s). Vocab-parallel statistics per row of a slice: (lse, z_target, sum_j z_j), combined
over the ranks by a log-sum-exp of the first column and sums of the others.
"""

from __future__ import annotations

import math

import torch

from liger_dispatch.compose import fused_linear as fl
from liger_dispatch.compose.grad_bounds import Bound, logit_bound
from liger_dispatch.compose.vocab_parallel import VocabParallel, VocabShard
from liger_dispatch.core.table import OpSpec
from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks as c
from liger_dispatch.registry import heads
from liger_dispatch.tuning import points as tp

CE_SCHEMA = ("ce_loss_and_grad(Tensor(a!) logits, Tensor target, *, Tensor? grad_scale=None, int ignore_index=-100, "
             "float label_smoothing=0.0, float? softcap=None, float lse_square_scale=0.0) -> Tensor")
FLCE_SCHEMA = ("flce(Tensor input, Tensor weight, Tensor target, Tensor? bias=None, *, int ignore_index=-100, "
               "str reduction='mean', float label_smoothing=0.0, float? softcap=None, float lse_square_scale=0.0, "
               "ScalarType? accum_dtype=None, str? process_group=None) -> Tensor")
VP_STATS_SCHEMA = ("ce_vp_stats(Tensor logits, Tensor target, *, int vocab_start=0, int ignore_index=-100, "
                   "float? softcap=None) -> Tensor")
VP_GRAD_SCHEMA = ("ce_vp_grad(Tensor(a!) logits, Tensor target, Tensor lse, *, int vocab_start=0, int vocab_size=0, "
                  "Tensor? grad_scale=None, int ignore_index=-100, float label_smoothing=0.0, float? softcap=None, "
                  "float lse_square_scale=0.0) -> ()")


# ---------------------------------------------------------------- checks


def _options(a):
    c.integer("ignore_index", a.ignore_index)
    c.in_range("label_smoothing", a.label_smoothing, 0.0, 1.0)
    if a.softcap is not None:
        c.positive("softcap", a.softcap)
    c.non_negative("lse_square_scale", a.lse_square_scale)


def check_flce(a):
    _, vocab = heads.head("input", a.input, "weight", a.weight)
    c.tensor("target", a.target, integer=True)
    heads.bias("bias", a.bias, vocab, "input", a.input)
    c.same_device(input=a.input, weight=a.weight, target=a.target, bias=a.bias)
    c.choice("reduction", a.reduction, ("mean", "sum", "none"))
    _options(a)
    heads.row_labels("target", a.target, "input", a.input)
    heads.accum_dtype(a.accum_dtype)


def check_ce_loss_and_grad(a):
    n, _ = heads.logits("logits", a.logits)
    c.tensor("target", a.target, ndim=1, integer=True)
    c.grad_scale(a.grad_scale, n)
    c.same_device(logits=a.logits, target=a.target, grad_scale=a.grad_scale)
    _options(a)
    heads.labels("target", a.target, n)


def ce_classes(a):
    c.class_indices("target", a.target, a.logits.shape[1], a.ignore_index)


def check_ce_vp_stats(a):
    n, _ = heads.logits("logits", a.logits)
    if a.target is not None:
        c.tensor("target", a.target, ndim=1, integer=True)
        c.rows("target", a.target.numel(), n, "number of labels")
    c.same_device(logits=a.logits, target=a.target)
    c.integer("vocab_start", a.vocab_start)
    c.non_negative("vocab_start", a.vocab_start)
    c.integer("ignore_index", a.ignore_index)
    if a.softcap is not None:
        c.positive("softcap", a.softcap)


def check_ce_vp_grad(a):
    check_ce_vp_stats(a)
    n = a.logits.shape[0]
    heads.row_stats("lse", a.lse, n, None)
    c.grad_scale(a.grad_scale, n)
    c.same_device(logits=a.logits, lse=a.lse, grad_scale=a.grad_scale)
    c.integer("vocab_size", a.vocab_size)
    if a.vocab_size != 0 and a.vocab_size < a.vocab_start + a.logits.shape[1]:
        raise InputError(f"vocab_size is {a.vocab_size} but the slice ends at column "
                           f"{a.vocab_start + a.logits.shape[1]}")
    c.in_range("label_smoothing", a.label_smoothing, 0.0, 1.0)
    c.non_negative("lse_square_scale", a.lse_square_scale)


def probe_flce(a):
    return ((heads.logits_spec(a.input, a.weight), heads.rows_spec(a.target)),
            dict(ignore_index=a.ignore_index, label_smoothing=a.label_smoothing, softcap=a.softcap,
                 lse_square_scale=a.lse_square_scale))


def fake_flce(a):
    shape = tuple(a.target.shape) if a.reduction == "none" else ()
    return a.input.new_empty(shape, dtype=heads.loss_dtype(a.input))


# ---------------------------------------------------------------- the composition


def grad_bound(x, weight, bias, *, softcap=None, lse_square_scale=0.0) -> Bound:
    """A bound of each row's gradient L1 norm over the raw logits (fp16 buffers, grad_bounds.py):
    |1 + 2 lse_square_scale lse| + 1 (p (1 + 2 s lse) minus one-hots weighing 1 in all); |lse| <= softcap + log V,
    or without a softcap max_j |u_ij| + log V."""
    if lse_square_scale == 0.0:
        return 2.0
    lse = (softcap if softcap is not None else logit_bound(x, weight, bias)) + math.log(weight.shape[0])
    return 2.0 + 2.0 * lse_square_scale * lse


def compose_flce(kernel, vocab_parallel=None):
    """flce from a backend's ce_loss_and_grad (or its vocab-parallel stand-in, with the shard): (loss, grad_input,
    grad_weight, grad_bias), the gradients of the ones `need_grads` asks for (else None); with row_weights, the
    loss is sum_i w_i loss_i."""

    def flce(input, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
             softcap=None, lse_square_scale=0.0, accum_dtype=None, process_group=None, need_grads=(),
             row_weights=None):
        want_dx, want_dw, want_db = fl.wanted_grads(need_grads, 3)
        x = fl.flat(input, input.shape[-1])
        labels = fl.flat(target).long()
        options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
                       lse_square_scale=lse_square_scale)
        if row_weights is not None:
            scale = fl.flat(row_weights).to(torch.float32)
        elif reduction == "mean":
            scale = 1.0 / fl.valid_count(labels, x.shape[0], ignore_index, x.device)
        else:
            scale = torch.ones((), device=x.device)

        def chunk_loss(logits, start, end, chunk_scale):
            return kernel(logits, labels[start:end], grad_scale=chunk_scale, **options)

        rows, dx, dw, db = fl.run_chunks(
            x, weight, bias, scale, chunk_loss, want_dx=want_dx, want_dw=want_dw, want_db=want_db and bias is not None,
            accum_dtype=accum_dtype, vocab_parallel=vocab_parallel,
            row_bound=lambda: grad_bound(x, weight, bias, softcap=softcap, lse_square_scale=lse_square_scale))
        if reduction == "none" and row_weights is None:
            loss = rows.view(target.shape)
        else:
            loss = (rows * scale).sum() if row_weights is not None else rows.sum() * scale
        return (loss, None if dx is None else dx.view(input.shape), dw,
                None if db is None else db.to(fl.grad_dtype(bias)))

    return flce


# ---------------------------------------------------------------- vocab-parallel


def loss_rows(stats: torch.Tensor, target: torch.Tensor, *, vocab_size: int, ignore_index: int,
              label_smoothing: float, lse_square_scale: float) -> torch.Tensor:
    """Per-row cross-entropy from the global ce_vp_stats (lse, z_target, sum z)."""
    lse, z_target, z_sum = stats.unbind(1)
    eps = label_smoothing
    loss = (1.0 - eps) * (lse - z_target) + eps * (lse - z_sum / vocab_size) + lse_square_scale * lse * lse
    return torch.where(target != ignore_index, loss, 0.0)


def vocab_parallel_kernel(shard: VocabShard, kernels):
    """ce_loss_and_grad of the composition, over this rank's slice."""

    def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                         lse_square_scale=0.0):
        # the op's own class check saw one slice (heads.target_classes skips a vocab-parallel call)
        c.class_indices("target", target, shard.total, ignore_index)
        stats = kernels("ce_vp_stats", logits, target, vocab_start=shard.start, ignore_index=ignore_index,
                        softcap=softcap)
        total = shard.combine(stats, lse_columns=1)
        kernels("ce_vp_grad", logits, target, total[:, 0], vocab_start=shard.start, vocab_size=shard.total,
                grad_scale=grad_scale, ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
                lse_square_scale=lse_square_scale)
        return loss_rows(total, target, vocab_size=shard.total, ignore_index=ignore_index,
                         label_smoothing=label_smoothing, lse_square_scale=lse_square_scale)

    return ce_loss_and_grad


# ---------------------------------------------------------------- tuning


def bucket(input, weight, target, bias=None, *, label_smoothing=0.0, softcap=None, lse_square_scale=0.0, **_):
    rest = (("v", tp.pow2_ceil(weight.shape[0])),)
    if softcap is not None or label_smoothing or lse_square_scale:
        rest += tuple((name, "on") for name, on in (("softcap", softcap is not None), ("smoothing", label_smoothing),
                                                    ("z-loss", lse_square_scale)) if on)
    return tp.pow2_ceil(tp.rows(input)), rest


def tune_points(n, hidden, vocab, dtype, device, args):
    shape, check = tp.lm_shape(n, hidden, vocab)
    x, w = tp.lm_head(n, hidden, vocab, dtype, device)
    yield tp.Point("flce", shape, tp.Inputs((x, w, tp.labels(n, vocab, device)), {}, [x, w]), check)


OPS = (
    OpSpec(CE_SCHEMA, "kernel", check_ce_loss_and_grad, value_check=ce_classes, fake=heads.fake_rows,
           summary="per-row cross-entropy of a logits chunk; gradient written into the logits"),
    OpSpec(VP_STATS_SCHEMA, "kernel", check_ce_vp_stats, fake=heads.fake_stats(3),
           summary="vocab-parallel CE: a slice's row stats (lse, target logit, sum)"),
    OpSpec(VP_GRAD_SCHEMA, "kernel", check_ce_vp_grad, fake=heads.fake_in_place,
           summary="vocab-parallel CE: a slice's gradient from the global lse"),
    OpSpec(FLCE_SCHEMA, "user", check_flce, value_check=heads.target_classes, aliases=("fused_linear_cross_entropy",),
           composed_of=("ce_loss_and_grad",), compose=compose_flce, probe=probe_flce,
           differentiable=("input", "weight", "bias"), autocast=("input", "weight", "bias"),
           impl_extra=f"{heads.NEED_GRADS}, {heads.ROW_WEIGHTS}", fake=fake_flce,
           vocab_parallel=VocabParallel("weight", sliced={"weight": 0, "bias": 0},
                                        replicated={"input": False, "target": True}, kernel=vocab_parallel_kernel),
           tuning=tp.Tuning(bucket, tp.lm_head_groups(tune_points)),
           summary="fused linear + cross-entropy (label smoothing, softcap, z-loss)"),
)
BACKEND_MODULES = {"ce_loss_and_grad": "ce", "ce_vp_stats": "vocab_parallel", "ce_vp_grad": "vocab_parallel"}
