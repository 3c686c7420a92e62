"""Cross-entropy of an LM head: the user-level `flce` (fused linear + cross-entropy, with class weights, label
smoothing, softcap and z-loss, and the z-loss and token accuracy as statistics) and the kernel-level ops it is
composed of, everything the machinery needs to serve them.

    flce(input [..., H], weight [V, H], target [...], bias [V]?, ce_weight [V]?) -> (loss, z_loss, token_accuracy)
    ce_loss_and_grad(logits [C, V], target [C]) -> loss rows [C]; logits overwritten by grad_scale * d loss / d logits,
        row_stats [C, 2] (when given) by each row's (lse, 1 if the target's logit is the row's max else 0)
    ce_vp_stats / ce_vp_grad: the same over one rank's vocabulary slice (vocab-parallel)

Per row, with class weights w (1 without ce_weight) and W = sum_j w_j:
    (1 - eps) w_y (lse - z_y) + eps / V sum_j w_j (lse - z_j) + lse_square_scale lse^2,
z = input @ weight.T + bias, with softcap s: z = s tanh(z / s); without weights the smoothing term is
eps (lse - mean_j z_j). This is torch's F.cross_entropy(weight=, label_smoothing=) plus the z-loss, as
liger-kernel's fused-linear cross-entropy computes it: a mean divides the cross-entropy by sum_i w_(y_i) over the
rows not ignored (torch's rule) and the z-loss, which no class weight scales, by the number of those rows.
Vocab-parallel statistics per row of a slice: (lse, max_j z_j, z_target, sum_j w_j z_j, sum_j w_j), combined over
the ranks by a log-sum-exp of the first column, a max of the second and sums of the others.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from liger_dispatch.compose import fused_linear as fl
from liger_dispatch.compose.grad_bounds import Bound, logit_bound, norm
from liger_dispatch.compose.vocab_parallel import VocabParallel, VocabShard
from liger_dispatch.core.table import OpSpec
from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks as c
from liger_dispatch.registry import heads
from liger_dispatch.registry.cases import (FP16, FP32, Case, Inputs, beyond_fp16_head, empty_head, empty_leaves,
                                           non_contiguous, overflow_head, sample_labels)
from liger_dispatch.tuning import points as tp

CE_SCHEMA = ("ce_loss_and_grad(Tensor(a!) logits, Tensor target, *, Tensor? grad_scale=None, int ignore_index=-100, "
             "float label_smoothing=0.0, float? softcap=None, float lse_square_scale=0.0, Tensor? ce_weight=None, "
             "Tensor(b!)? row_stats=None) -> Tensor")
FLCE_SCHEMA = ("flce(Tensor input, Tensor weight, Tensor target, Tensor? bias=None, Tensor? ce_weight=None, *, "
               "int ignore_index=-100, str reduction='mean', float label_smoothing=0.0, float? softcap=None, "
               "float lse_square_scale=0.0, bool return_z_loss=False, bool return_token_accuracy=False, "
               "ScalarType? accum_dtype=None, str? process_group=None) -> (Tensor, Tensor, Tensor)")
VP_STATS_SCHEMA = ("ce_vp_stats(Tensor logits, Tensor target, *, int vocab_start=0, int ignore_index=-100, "
                   "float? softcap=None, Tensor? ce_weight=None) -> Tensor")
VP_GRAD_SCHEMA = ("ce_vp_grad(Tensor(a!) logits, Tensor target, Tensor stats, *, int vocab_start=0, int vocab_size=0, "
                  "Tensor? grad_scale=None, int ignore_index=-100, float label_smoothing=0.0, float? softcap=None, "
                  "float lse_square_scale=0.0, Tensor? ce_weight=None) -> ()")
# the columns of a vocab-parallel statistics row: LSE combines by log-sum-exp, MAX by max, the others by sums
LSE, MAX, Z_TARGET, WEIGHTED_Z_SUM, WEIGHT_SUM = range(5)
VP_STATS = 5


class CrossEntropyOutput(NamedTuple):
    """What flce returns when return_z_loss or return_token_accuracy asks for more than the loss (liger-kernel's
    CrossEntropyOutput, as a tuple): the loss (the z-loss included), the z-loss term alone and the token accuracy,
    None where not asked for. Neither statistic has a gradient of its own (they are for logging)."""

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None


# ---------------------------------------------------------------- checks


def _options(a):
    c.integer("ignore_index", a.ignore_index)
    c.in_range("label_smoothing", a.label_smoothing, 0.0, 1.0)
    if a.softcap is not None:
        c.positive("softcap", a.softcap)
    c.non_negative("lse_square_scale", a.lse_square_scale)


def _ce_weight(value, classes: Optional[int], contiguous: bool) -> None:
    """Optional class weights: a float vector of one weight per class of the whole vocabulary (`classes` of them,
    None where the caller cannot know the whole vocabulary's size: a vocab-parallel call's slice)."""
    if value is None:
        return
    c.tensor("ce_weight", value, ndim=1, floating=True)
    if classes is not None:
        c.dim_equals("ce_weight", value.shape[0], classes, "length", "one weight per class")
    if contiguous:
        c.last_dim_contiguous("ce_weight", value)


def check_flce(a):
    _, vocab = heads.head("input", a.input, "weight", a.weight)
    c.tensor("target", a.target, integer=True)
    heads.bias("bias", a.bias, vocab, "input", a.input)
    _ce_weight(a.ce_weight, None if a.process_group is not None else vocab, contiguous=False)
    c.same_device(input=a.input, weight=a.weight, target=a.target, bias=a.bias, ce_weight=a.ce_weight)
    c.choice("reduction", a.reduction, ("mean", "sum", "none"))
    _options(a)
    c.boolean("return_z_loss", a.return_z_loss)
    c.boolean("return_token_accuracy", a.return_token_accuracy)
    heads.row_labels("target", a.target, "input", a.input)
    heads.accum_dtype(a.accum_dtype)


def check_ce_loss_and_grad(a):
    n, vocab = heads.logits("logits", a.logits)
    c.tensor("target", a.target, ndim=1, integer=True)
    c.grad_scale(a.grad_scale, n)
    _ce_weight(a.ce_weight, vocab, contiguous=True)
    if a.row_stats is not None:
        heads.row_stats("row_stats", a.row_stats, n, 2)
        if not a.row_stats.is_contiguous():
            raise InputError(f"row_stats must be contiguous, got strides {a.row_stats.stride()}")
    c.same_device(logits=a.logits, target=a.target, grad_scale=a.grad_scale, ce_weight=a.ce_weight,
                  row_stats=a.row_stats)
    _options(a)
    heads.labels("target", a.target, n)


def ce_classes(a):
    c.class_indices("target", a.target, a.logits.shape[1], a.ignore_index)


def _slice_weights(a, classes: int) -> None:
    """The class weights of a vocab-parallel pass: the whole vocabulary's, at least up to the slice's end."""
    _ce_weight(a.ce_weight, None, contiguous=True)
    if a.ce_weight is not None and a.ce_weight.shape[0] < classes:
        raise InputError(f"ce_weight holds {a.ce_weight.shape[0]} class weights but the slice ends at class {classes}: "
                         "pass the whole vocabulary's")


def check_ce_vp_stats(a):
    n, width = heads.logits("logits", a.logits)
    if a.target is not None:
        c.tensor("target", a.target, ndim=1, integer=True)
        c.rows("target", a.target.numel(), n, "number of labels")
    c.same_device(logits=a.logits, target=a.target, ce_weight=a.ce_weight)
    c.integer("vocab_start", a.vocab_start)
    c.non_negative("vocab_start", a.vocab_start)
    c.integer("ignore_index", a.ignore_index)
    if a.softcap is not None:
        c.positive("softcap", a.softcap)
    _slice_weights(a, a.vocab_start + width)


def check_ce_vp_grad(a):
    check_ce_vp_stats(a)
    n = a.logits.shape[0]
    heads.row_stats("stats", a.stats, n, VP_STATS)
    c.grad_scale(a.grad_scale, n)
    c.same_device(logits=a.logits, stats=a.stats, grad_scale=a.grad_scale)
    c.integer("vocab_size", a.vocab_size)
    if a.vocab_size != 0 and a.vocab_size < a.vocab_start + a.logits.shape[1]:
        raise InputError(f"vocab_size is {a.vocab_size} but the slice ends at column "
                           f"{a.vocab_start + a.logits.shape[1]}")
    if a.vocab_size != 0:
        _ce_weight(a.ce_weight, a.vocab_size, contiguous=True)
    c.in_range("label_smoothing", a.label_smoothing, 0.0, 1.0)
    c.non_negative("lse_square_scale", a.lse_square_scale)


def probe_flce(a):
    return ((heads.logits_spec(a.input, a.weight), heads.rows_spec(a.target)),
            dict(ignore_index=a.ignore_index, label_smoothing=a.label_smoothing, softcap=a.softcap,
                 lse_square_scale=a.lse_square_scale, ce_weight=heads.rows_spec(a.ce_weight)))


def fake_flce(a):
    rows = tuple(a.target.shape) if a.reduction == "none" else ()

    def output(asked):
        return a.input.new_empty(rows if asked else (0,), dtype=heads.loss_dtype(a.input))

    return output(True), output(a.return_z_loss), output(a.return_token_accuracy)


def flce_result(a, outputs):
    """What a call returns: the loss alone, or a CrossEntropyOutput when it asks for the z-loss or the accuracy."""
    loss, z_loss, token_accuracy = outputs
    if not (a.return_z_loss or a.return_token_accuracy):
        return loss
    return CrossEntropyOutput(loss, z_loss if a.return_z_loss else None,
                              token_accuracy if a.return_token_accuracy else None)


# ---------------------------------------------------------------- the composition


def grad_bound(x, weight, bias, *, softcap=None, lse_square_scale=0.0, ce_weight=None) -> Bound:
    """A bound of each row's gradient L1 norm over the raw logits (fp16 buffers, grad_bounds.py):
    2 max_j |w_j| + 2 lse_square_scale |lse| (p ((1 - eps) w_y + eps W / V + 2 s lse) minus (1 - eps) w_y at the
    target and eps w_j / V everywhere); |lse| <= softcap + log V, or without a softcap max_j |u_ij| + log V."""
    weights = 1.0 if ce_weight is None else norm(ce_weight, math.inf)
    if lse_square_scale == 0.0:
        return 2.0 * weights
    lse = (softcap if softcap is not None else logit_bound(x, weight, bias)) + math.log(weight.shape[0])
    return 2.0 * weights + 2.0 * lse_square_scale * lse


def class_weights(ce_weight, dtype, labels, ignore_index, count, mean) -> Optional[torch.Tensor]:
    """The class weights the kernels take, contiguous in `dtype` (the loss's); for a mean times count / sum_i w_(y_i)
    over the rows not ignored, so that the kernels' common scale 1 / count divides the cross-entropy by the sum of
    the target weights (torch's rule) and the z-loss by the count (liger-kernel's). A zero sum gives weights 0: a
    mean over nothing is 0, as when every row is ignored."""
    if ce_weight is None:
        return None
    weights = ce_weight.to(dtype).contiguous()
    if not mean:
        return weights
    target_sum = target_weights(weights, labels, ignore_index).sum()
    return weights * torch.where(target_sum != 0, count / target_sum, 0.0)


def row_statistics(row_stats, count, reduction, lse_square_scale, shape):
    """(z-loss, token accuracy) from each row's (lse, target is the max): the z-loss reduced as the loss (its mean
    over the rows not ignored), the accuracy their fraction (per row for reduction="none")."""
    lse, correct = row_stats.unbind(1)
    z_rows = lse_square_scale * lse.square()
    if reduction == "none":
        return z_rows.view(shape), correct.contiguous().view(shape)  # an output of its own, not a view of the stats
    z_loss = z_rows.sum()
    return (z_loss / count if reduction == "mean" else z_loss), correct.sum() / count


def compose_flce(kernel, vocab_parallel=None):
    """flce from a backend's ce_loss_and_grad (or its vocab-parallel stand-in, with the shard): (loss, z_loss,
    token_accuracy, grad_input, grad_weight, grad_bias), the statistics empty where not asked for and the
    gradients of the ones `need_grads` asks for (else None); with row_weights, the loss is sum_i w_i loss_i."""

    def flce(input, weight, target, bias=None, ce_weight=None, *, ignore_index=-100, reduction="mean",
             label_smoothing=0.0, softcap=None, lse_square_scale=0.0, return_z_loss=False,
             return_token_accuracy=False, accum_dtype=None, process_group=None, need_grads=(), row_weights=None,
             logits_grad=False):
        want_dx, want_dw, want_db = fl.wanted_grads(need_grads, 3)
        x = fl.flat(input, input.shape[-1])
        labels = fl.flat(target).long()
        mean = reduction == "mean" and row_weights is None
        asked = (return_z_loss or return_token_accuracy) and row_weights is None  # a backward needs no statistics
        # No gradient to scale and no class weight to rescale by the count: the mean's count after the rows, in the
        # launch that reduces them (fl.mean_after; no_grad: four launches, as torch's own cross-entropy)
        mean_after = mean and not (want_dx or want_dw or want_db) and ce_weight is None
        count, inverse = fl.valid_count(labels, ignore_index) if (mean or asked) and not mean_after else (None, None)
        weights = class_weights(ce_weight, heads.loss_dtype(x), labels, ignore_index, count, mean)
        options = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
                       lse_square_scale=lse_square_scale, ce_weight=weights)
        if row_weights is not None:
            scale = fl.flat(row_weights).to(torch.float32)
        elif mean_after or not mean:
            scale = None  # 1
        else:
            scale = inverse
        row_stats = x.new_empty(x.shape[0], 2, dtype=heads.loss_dtype(x)) if asked else None

        def chunk_loss(logits, start, end, chunk_scale):
            return kernel(logits, fl.chunk_of(labels, start, end), grad_scale=chunk_scale,
                          row_stats=fl.chunk_of(row_stats, start, end), **options)

        rows, dx, dw, db = fl.run_chunks(
            x, weight, bias, scale, chunk_loss, want_dx=want_dx, want_dw=want_dw, want_db=want_db and bias is not None,
            accum_dtype=accum_dtype, vocab_parallel=vocab_parallel, logits_grad=logits_grad,
            row_bound=lambda: grad_bound(x, weight, bias, softcap=softcap, lse_square_scale=lse_square_scale,
                                         ce_weight=weights))
        if reduction == "none" and row_weights is None:
            loss = rows.view(target.shape)
        elif mean_after:
            loss, count = fl.mean_after(rows, labels, ignore_index)
        elif row_weights is not None:
            loss = (rows * scale).sum()
        else:
            loss = rows.sum() if scale is None else rows.sum() * scale
        z_loss, token_accuracy = (row_statistics(row_stats, count, reduction, lse_square_scale, target.shape)
                                  if asked else (None, None))
        return (loss, z_loss if return_z_loss else loss.new_empty(0),  # two empties: a torch op's outputs never alias
                token_accuracy if return_token_accuracy else loss.new_empty(0),
                None if dx is None else dx.view(input.shape), dw, None if db is None else db.to(fl.grad_dtype(bias)))

    return flce


# ---------------------------------------------------------------- vocab-parallel


def target_weights(weights, target, ignore_index) -> Optional[torch.Tensor]:
    """Each row's w_y (0 where ignored), or None without class weights."""
    if weights is None:
        return None
    valid = target != ignore_index
    return torch.where(valid, weights[torch.where(valid, target, 0)], 0.0)


def loss_rows(stats: torch.Tensor, target: torch.Tensor, weights: Optional[torch.Tensor], *, vocab_size: int,
              ignore_index: int, label_smoothing: float, lse_square_scale: float) -> torch.Tensor:
    """Per-row cross-entropy from the global ce_vp_stats and the class weights (None: 1)."""
    lse, z_target = stats[:, LSE], stats[:, Z_TARGET]
    nll = lse - z_target
    if weights is not None:
        nll = target_weights(weights, target, ignore_index) * nll
    smooth = (stats[:, WEIGHT_SUM] * lse - stats[:, WEIGHTED_Z_SUM]) / vocab_size
    loss = (1.0 - label_smoothing) * nll + label_smoothing * smooth + lse_square_scale * lse * lse
    return torch.where(target != ignore_index, loss, 0.0)


def write_row_stats(row_stats: Optional[torch.Tensor], stats: torch.Tensor, valid: torch.Tensor) -> None:
    """row_stats <- (lse, 1 where the target's logit is the row's max) from the global ce_vp_stats, 0 where ignored."""
    if row_stats is None:
        return
    correct = valid & (stats[:, Z_TARGET] >= stats[:, MAX])
    row_stats.copy_(torch.stack([torch.where(valid, stats[:, LSE], 0.0), correct.to(stats.dtype)], dim=1))


def vocab_parallel_kernel(shard: VocabShard, kernels):
    """ce_loss_and_grad of the composition, over this rank's slice (ce_weight: the whole vocabulary's)."""

    def ce_loss_and_grad(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
                         lse_square_scale=0.0, ce_weight=None, row_stats=None):
        # the op's own checks saw one slice (heads.target_classes skips a vocab-parallel call)
        c.class_indices("target", target, shard.total, ignore_index)
        _ce_weight(ce_weight, shard.total, contiguous=True)
        stats = kernels("ce_vp_stats", logits, target, vocab_start=shard.start, ignore_index=ignore_index,
                        softcap=softcap, ce_weight=ce_weight)
        total = shard.combine(stats, lse_columns=1, max_columns=1)
        kernels("ce_vp_grad", logits, target, total, vocab_start=shard.start, vocab_size=shard.total,
                grad_scale=grad_scale, ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
                lse_square_scale=lse_square_scale, ce_weight=ce_weight)
        write_row_stats(row_stats, total, target != ignore_index)
        return loss_rows(total, target, ce_weight, vocab_size=shard.total, ignore_index=ignore_index,
                         label_smoothing=label_smoothing, lse_square_scale=lse_square_scale)

    return ce_loss_and_grad


# ---------------------------------------------------------------- tuning


def bucket(input, weight, target, bias=None, ce_weight=None, *, label_smoothing=0.0, softcap=None,
           lse_square_scale=0.0, **_):
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
    OpSpec(VP_STATS_SCHEMA, "kernel", check_ce_vp_stats, fake=heads.fake_stats(VP_STATS),
           summary="vocab-parallel CE: a slice's row stats (lse, max, target logit, weighted sum, weight sum)"),
    OpSpec(VP_GRAD_SCHEMA, "kernel", check_ce_vp_grad, fake=heads.fake_in_place,
           summary="vocab-parallel CE: a slice's gradient from the global stats"),
    OpSpec(FLCE_SCHEMA, "user", check_flce, value_check=heads.target_classes, aliases=("fused_linear_cross_entropy",),
           composed_of=("ce_loss_and_grad",), compose=compose_flce, probe=probe_flce,
           differentiable=("input", "weight", "bias"), autocast=("input", "weight", "bias"),
           impl_extra=f"{heads.NEED_GRADS}, {heads.ROW_WEIGHTS}, {heads.LOGITS_GRAD}", fake=fake_flce, result=flce_result,
           logits_grad=lambda a: heads.keeps_logits_grad(a.input, a.weight, a.accum_dtype, a.process_group),
           vocab_parallel=VocabParallel("weight", sliced={"weight": 0, "bias": 0},
                                        replicated={"input": False, "target": True, "ce_weight": True},
                                        kernel=vocab_parallel_kernel),
           tuning=tp.Tuning(bucket, tp.lm_head_groups(tune_points)),
           summary="fused linear + cross-entropy (class weights, label smoothing, softcap, z-loss, accuracy)"),
)
BACKEND_MODULES = {"ce_loss_and_grad": "ce", "ce_vp_stats": "vocab_parallel", "ce_vp_grad": "vocab_parallel"}


# ---------------------------------------------------------------- conformance cases and samples (testing.py)
HEAD = ("input", "weight")
STATS = dict(return_z_loss=True, return_token_accuracy=True)
FLCE_OPTIONS = {  # every reduction, and each term of the loss alone and together
    "mean": dict(),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "smoothing": dict(label_smoothing=0.1),
    "softcap_zloss": dict(softcap=3.0, lse_square_scale=1e-2),
    "everything": dict(label_smoothing=0.2, softcap=2.0, lse_square_scale=1e-3, reduction="sum"),
}


def _flce(**options):
    def build(m: Inputs):
        inputs = dict(input=m.randn(m.N, m.H), weight=m.weight(), target=m.labels(m.N, ignored=(1,)))
        return inputs, options
    return build


def _flce_bias_3d_noncontiguous(m: Inputs):
    inputs = dict(input=non_contiguous(m.randn(2, 4, m.H)), weight=m.weight(),
                  target=m.labels(8, ignored=(0, 5)).view(2, 4), bias=m.randn(m.V))
    return inputs, dict(label_smoothing=0.05)


def _flce_weighted(reduction, weight_scale=1.0, all_ignored=False, **options):
    """Class weights in [0.2, 2.2) times weight_scale, and a third of the rows' targets the row's max (so the token
    accuracy is not 0 by chance; fp32 cases only: a lower precision's logits may tie or swap the top two)."""
    def build(m: Inputs):
        x, w = m.randn(m.N, m.H), m.weight()
        target = m.labels(m.N, ignored=(1,), all_ignored=all_ignored)
        if not all_ignored:
            target[::3] = (x.float() @ w.float().T).argmax(-1)[::3]
        ce_weight = (torch.rand(m.V, device=m.device) * 2 + 0.2) * weight_scale
        return dict(input=x, weight=w, target=target, bias=None, ce_weight=ce_weight), dict(reduction=reduction,
                                                                                            **options)
    return build


def _flce_rows(rows, strided=False):
    def build(m: Inputs):
        n = max(rows, 3)
        target = m.labels(n, ignored=(1,) if strided else (), all_ignored=rows == 0, strided=strided)
        return dict(input=m.randn(n, m.H), weight=m.weight(), target=target), {}
    return build


def _empty(**options):
    def build(m: Inputs):
        x, w = empty_head(m)
        return empty_leaves(dict(input=x, weight=w, target=m.labels(0), bias=m.randn(m.V))), options
    return build


def _fp16_overflow(logit_scale, **options):
    def build(m: Inputs):
        x, w = overflow_head(m, logit_scale)
        return dict(input=x, weight=w, target=m.labels(m.N, ignored=(1,))), options
    return build


def _fp16_beyond(m: Inputs):
    """Every row pushing one vocabulary row."""
    x, w = beyond_fp16_head(m)
    return dict(input=x, weight=w, target=torch.full((x.shape[0],), 3, device=m.device)), dict(reduction="sum")


CASES = {"flce": [
    *(Case(name, _flce(**options), HEAD, smoke=name == "smoothing", sample=name == "everything")
      for name, options in FLCE_OPTIONS.items()),
    Case("bias_3d_noncontiguous", _flce_bias_3d_noncontiguous, (*HEAD, "bias")),
    Case("single_row", _flce_rows(1), HEAD),
    Case("strided_labels", _flce_rows(16, strided=True), HEAD),
    Case("all_ignored", _flce_rows(0), HEAD),
    Case("empty-mean", _empty(reduction="mean"), kind="empty", extra_dtypes=FP16),
    Case("empty-sum-zloss", _empty(reduction="sum", lse_square_scale=0.1), kind="empty", extra_dtypes=FP16),
    Case("empty-none", _empty(reduction="none"), kind="empty", extra_dtypes=FP16),
    Case("fp16-zloss-softcap", _fp16_overflow(8.0, softcap=20.0, lse_square_scale=0.5, reduction="sum"), HEAD,
         dtypes=FP16),
    Case("fp16-zloss-none", _fp16_overflow(8.0, lse_square_scale=0.5, reduction="none"), HEAD, dtypes=FP16),
    Case("fp16-grad-beyond-fp16", _fp16_beyond, HEAD, upstream=0.25, dtypes=FP16),
    # liger-kernel's options: class weights, the z-loss and the token accuracy returned (no gradient of their own)
    Case("weights-mean-stats", _flce_weighted("mean", label_smoothing=0.1, lse_square_scale=1e-2, **STATS), HEAD,
         used=(0,), dtypes=FP32),
    Case("weights-none-stats", _flce_weighted("none", lse_square_scale=1e-2, **STATS), HEAD, used=(0,), dtypes=FP32),
    Case("weights-sum-softcap", _flce_weighted("sum", softcap=3.0, label_smoothing=0.2), HEAD),
    Case("weights-all-ignored-stats", _flce_weighted("mean", all_ignored=True, label_smoothing=0.1, **STATS), HEAD,
         used=(0,), dtypes=FP32),
    Case("fp16-large-weights", _flce_weighted("sum", weight_scale=64.0, label_smoothing=0.1), HEAD, dtypes=FP16),
]}


def _ce_sample(m: Inputs):
    return (m.randn(6, 40, scale=4.0), sample_labels(m)), dict(
        grad_scale=torch.rand(6, device=m.device) + 0.1, label_smoothing=0.1,
        ce_weight=torch.rand(40, device=m.device) + 0.5, row_stats=torch.zeros(6, 2, device=m.device))


def _ce_vp_grad_sample(m: Inputs):
    from liger_dispatch import dispatch

    logits, target = m.randn(6, 40, scale=4.0), sample_labels(m, vocab=80)
    weights = torch.rand(80, device=m.device) + 0.5
    stats = dispatch.op("ce_vp_stats", backend="reference")(logits, target, vocab_start=30, ce_weight=weights)
    return (logits, target, stats), dict(vocab_start=30, vocab_size=80, label_smoothing=0.1, ce_weight=weights)


SAMPLES = {
    "ce_loss_and_grad": _ce_sample,
    "ce_vp_stats": lambda m: ((m.randn(6, 40, scale=4.0), sample_labels(m, vocab=80)),
                              dict(vocab_start=30, ce_weight=torch.rand(80, device=m.device) + 0.5)),
    "ce_vp_grad": _ce_vp_grad_sample,
}
