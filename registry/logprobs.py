"""Per-token log-probs and entropy of an LM head, the primitive of RL and preference training: the kernel-level ops.

A chunk of logits [C, Vl] holds the columns [vocab_start, vocab_start + Vl) of a vocabulary (vocab_start = 0 and
Vl = V on one GPU; a vocab-parallel rank passes its slice). With z = logits / T:

    logprobs_stats -> [C, 3] fp32 per row over this slice: (lse = logsumexp_j z_j, z_target = z[target -
        vocab_start] when the target lies in this slice else 0, mean = sum_j softmax(z)_j z_j under this slice's
        own softmax). logprob = z_target - lse, entropy = lse - mean; slices combine as lse = logsumexp_r lse_r,
        z_target = sum_r z_target_r, mean = sum_r exp(lse_r - lse) mean_r (the driver's job;
        backends/reference/formulas.py:combine_logprobs_stats is the formula). An empty slice has lse -inf.
    logprobs_grad  -> overwrites the logits (their own dtype) with d(sum_i g_i logprob_i + h_i entropy_i)/d logits
        from the GLOBAL statistics: (g (1[j + vocab_start == target] - p_j) - h p_j (z_j - mean)) / T,
        p_j = exp(z_j - lse). g = grad_logprobs, h = grad_entropy, [C] fp32; None is 0 and is never read.

Rows whose target is ignore_index: zero statistics and a zero gradient, whatever global statistics come in.

The user-level op over them, with a backward of its own (the RL loss that consumes the log-probs comes after it):

    fused_linear_logprobs(input [..., H], weight [V, H], target [...], bias [V]?) -> (logprobs, entropy), fp32, the
        target's shape; z = (input @ weight.T + bias) / T. Ignored rows: 0 in both, no gradient.

Chunks are slices of the vocabulary, all rows each (compose/vocab_chunks.py): each slice of dW is one GEMM, rounded
once, as torch's unchunked matmul is. Forward, per slice: logits = x @ W_s.T (+ bias_s) into their place in one
buffer, logprobs_stats at the slice's vocab_start; the slices' statistics combine as ranks' do (`combine_stats`).
The buffer is kept for the backward, and dW becomes its first bytes: the logits kept live in the memory dW will
take (vocab_chunks.Layout). Backward, given g = d/d logprobs and h = d/d entropy (either may be None: an entropy
only logged is never read): the kept slices' logits are read where the forward left them, the others recomputed;
logprobs_grad turns them into dz in place; dX += dz W_s (fp32), dW_s = dz^T x, db_s = sum dz. Cost: 6 N H V FLOPs
while [N, V] fits in dW's memory plus the budget, 2 N H more a recomputed column beyond it. At H = 4096,
V = 128256 bf16 and the 512 MB budget: N <= 4096 all kept (6 N H V; the buffer 1.1-1.5 GB, dW's 1.05 GB
included), N = 8192 57 % kept (1.14x of 6 N H V), 16384 26 % (1.25x).

Vocab-parallel (process_group= or a DTensor weight): each rank's statistics over its slice, for all rows, are
all-gathered once ([W, N, 3]) and combined (`combine_stats`); the backward needs no statistics from the other ranks,
only the all-reduce of dX (and for fp16 that of the gradient bound).
"""

from __future__ import annotations

import torch

import functools

from liger_dispatch.compose import fused_linear as fl
from liger_dispatch.compose import vocab_chunks
from liger_dispatch.compose.grad_bounds import logit_bound, split_scale
from liger_dispatch.compose.vocab_parallel import VocabParallel
from liger_dispatch.core.table import OpSpec
from liger_dispatch.errors import InputError
from liger_dispatch.registry import checks as c
from liger_dispatch.registry import heads
from liger_dispatch.registry.cases import FP16, Case, Inputs, empty_head, empty_leaves, non_contiguous, sample_labels
from liger_dispatch.registry.heads import fake_in_place, fake_rows
from liger_dispatch.tuning import points as tp

STATS_SCHEMA = ("logprobs_stats(Tensor logits, Tensor target, *, int vocab_start=0, float temperature=1.0, "
                "int ignore_index=-100) -> Tensor")
GRAD_SCHEMA = ("logprobs_grad(Tensor(a!) logits, Tensor target, Tensor stats, Tensor? grad_logprobs=None, "
               "Tensor? grad_entropy=None, *, int vocab_start=0, float temperature=1.0, int ignore_index=-100) -> ()")
USER_SCHEMA = ("fused_linear_logprobs(Tensor input, Tensor weight, Tensor target, Tensor? bias=None, *, "
               "float temperature=1.0, int ignore_index=-100, ScalarType? accum_dtype=None, str? process_group=None) "
               "-> (Tensor, Tensor)")
STATS_COLUMNS = 3  # lse, z_target, mean


def _per_row_float(name, t, n, shape):
    """A per-row fp32 tensor (float64 allowed: the reference's gradcheck) of exactly `shape`, any strides."""
    c.tensor(name, t)
    if t.dtype not in (torch.float32, torch.float64) or tuple(t.shape) != shape:
        raise InputError(f"{name} must be float32 of shape {list(shape)} (one value per row of the {n} rows of "
                         f"logits), got {t.dtype} {tuple(t.shape)}")


def check_logprobs_stats(a):
    c.tensor("logits", a.logits, ndim=2, floating=True)  # [C, Vl], Vl may be 0 (an empty slice)
    c.last_dim_contiguous("logits", a.logits)
    n = a.logits.shape[0]
    c.tensor("target", a.target, ndim=1, integer=True)
    c.rows("target", a.target.numel(), n, "number of targets")
    c.same_device(logits=a.logits, target=a.target)
    c.integer("vocab_start", a.vocab_start)
    c.non_negative("vocab_start", a.vocab_start)
    c.positive("temperature", a.temperature)
    c.integer("ignore_index", a.ignore_index)


def check_logprobs_grad(a):
    check_logprobs_stats(a)
    n = a.logits.shape[0]
    _per_row_float("stats", a.stats, n, (n, STATS_COLUMNS))
    for name in ("grad_logprobs", "grad_entropy"):
        if getattr(a, name) is not None:
            _per_row_float(name, getattr(a, name), n, (n,))
    c.same_device(logits=a.logits, stats=a.stats, grad_logprobs=a.grad_logprobs, grad_entropy=a.grad_entropy)


def fake_stats(a):
    """[C, 3] fp32 (float64 for float64 logits, as the reference computes)."""
    return fake_rows(a, STATS_COLUMNS)


def check_user_op(a):
    _, vocab = heads.head("input", a.input, "weight", a.weight)
    heads.row_labels("target", a.target, "input", a.input)
    heads.bias("bias", a.bias, vocab, "input", a.input)
    c.same_device(input=a.input, weight=a.weight, target=a.target, bias=a.bias)
    c.positive("temperature", a.temperature)
    c.integer("ignore_index", a.ignore_index)
    heads.accum_dtype(a.accum_dtype)


def probe_user_op(a):
    return ((heads.logits_spec(a.input, a.weight), heads.rows_spec(a.target)),
            dict(temperature=a.temperature, ignore_index=a.ignore_index))


def _row_dtype(x: torch.Tensor) -> torch.dtype:
    """The per-row results' dtype: fp32 (float64 for float64 inputs, as the reference computes)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def fake_user_op(a):
    """(logprobs, entropy) in the target's shape, then what the backward needs: the statistics [N, 3] and the bytes
    of the buffer that keeps the logits (vocab_chunks.layout)."""
    dtype = _row_dtype(a.input)
    nbytes = vocab_chunks.layout(fl.flat(a.input, a.input.shape[-1]), a.weight).nbytes
    return (a.input.new_empty(a.target.shape, dtype=dtype), a.input.new_empty(a.target.shape, dtype=dtype),
            a.input.new_empty((a.target.numel(), STATS_COLUMNS), dtype=dtype),
            a.input.new_empty((nbytes,), dtype=torch.uint8))


def combine_stats(gathered: torch.Tensor) -> torch.Tensor:
    """The whole vocabulary's [C, 3] statistics from every rank's [W, C, 3] (the same order on every rank):
    lse = logsumexp_r lse_r, z_target = sum_r z_target_r, mean = sum_r exp(lse_r - lse) mean_r (an empty slice, lse_r =
    -inf, weighs 0; ignored rows come out (log W, 0, 0), masked by the caller)."""
    lse = torch.logsumexp(gathered[..., 0], dim=0)
    weight = torch.exp(gathered[..., 0] - lse)
    return torch.stack([lse, gathered[..., 1].sum(0), (weight * gathered[..., 2]).sum(0)], dim=1)


def vocab_parallel_kernels(shard, kernels):
    """The composition's two kernel-level ops over this rank's slice: the selected backend's own (they take the
    slice's vocab_start); the composition combines the statistics."""
    return functools.partial(kernels, "logprobs_stats"), functools.partial(kernels, "logprobs_grad")


class FusedLinearLogProbs:
    """fused_linear_logprobs composed from a backend's logprobs_stats / logprobs_grad (the module docstring says the
    algorithm): calling it returns (logprobs, entropy, stats, the logits' buffer); `backward` returns the gradients of
    (input, weight, bias). Autograd around it is the machinery's (core/torch_ops.py). vocab_parallel: the
    VocabShard of a vocab-parallel call. accum_dtype changes nothing here: no gradient is accumulated in a narrow
    dtype (dW is one GEMM per slice, dX sums in fp32)."""

    def __init__(self, stats, grad, vocab_parallel=None):
        self.stats, self.grad, self.shard = stats, grad, vocab_parallel

    def _options(self, start, temperature, ignore_index):
        offset = 0 if self.shard is None else self.shard.start
        return dict(vocab_start=offset + start, temperature=temperature, ignore_index=ignore_index)

    def __call__(self, input, weight, target, bias=None, *, temperature=1.0, ignore_index=-100, accum_dtype=None,
                 process_group=None):
        x, labels = fl.flat(input, input.shape[-1]), fl.flat(target).long()
        if self.shard is not None:  # the op's own class check saw one slice (heads.target_classes)
            c.class_indices("target", labels, self.shard.total, ignore_index)

        def stats_of(logits, start):
            return self.stats(logits, labels, **self._options(start, temperature, ignore_index))

        stats, buffer = vocab_chunks.forward(x, weight, bias, stats_of, combine_stats)
        if self.shard is not None:
            stats = combine_stats(self.shard.gather(stats))
        lse, z_target, mean = (s.view(target.shape) for s in stats.unbind(1))
        valid = target != ignore_index
        return torch.where(valid, z_target - lse, 0.0), torch.where(valid, lse - mean, 0.0), stats, buffer

    def backward(self, input, weight, target, bias, stats, buffer, grad_logprobs, grad_entropy, *,
                 need_grads=(True, True, True), temperature=1.0, ignore_index=-100, accum_dtype=None,
                 process_group=None):
        """-> (grad_input [..., H], grad_weight [V, H], grad_bias [V]), None where need_grads (one per input, weight,
        bias) says no or bias is None: a frozen head costs no dW GEMMs (2 N H V FLOPs)."""
        x, labels = fl.flat(input, input.shape[-1]), fl.flat(target).long()
        g, h = (None if t is None else fl.flat(t).to(stats.dtype).contiguous() for t in (grad_logprobs, grad_entropy))
        unscale = None
        if x.dtype == torch.float16 and x.shape[0]:
            def row_bound():
                return grad_bound(x, weight, bias, g, h, temperature=temperature)

            bound = row_bound() if self.shard is None else self.shard.bound_over_ranks(row_bound, x, weight.shape[0])
            if weight.shape[0]:  # an empty vocabulary slice writes no gradient
                scale, unscale = split_scale(torch.ones((), device=x.device), bound, weight)
                g, h = (None if t is None else t * scale for t in (g, h))

        def grad_of(logits, start):
            self.grad(logits, labels, stats, g, h, **self._options(start, temperature, ignore_index))

        want_dx, want_dw, want_db = need_grads
        dx, dw, db = vocab_chunks.backward(x, weight, bias, buffer, grad_of, want_dx=want_dx, want_dw=want_dw,
                                           want_db=want_db and bias is not None, unscale=unscale)
        if dx is not None:
            if self.shard is not None:
                self.shard.sum_over_ranks(dx)
            dx = dx.view(input.shape)
        return dx, dw, None if db is None else db.to(fl.grad_dtype(bias))


def grads_in_saved(a, saved) -> dict:
    """dW where the backward writes it: the first bytes of the saved buffer, beyond the budget (vocab_chunks)."""
    plan = vocab_chunks.layout(fl.flat(a.input, a.input.shape[-1]), a.weight)
    return {"weight": plan.grad_weight(saved[1], a.weight)} if plan.grad_bytes else {}


def grad_bound(x, weight, bias, g, h, *, temperature):
    """[N] bounds of each row's gradient L1 norm over the raw logits (fp16 buffers, grad_bounds.py):
    (|g| sum_j |1[j = t] - p_j| + |h| sum_j p_j |z_j - mean|) / T <= (2 |g| + 2 |h| max_j |z_j|) / T, with
    |z_j| <= max_j |x . w_j + b_j| / T (mean is a p-weighted mean of the z_j)."""
    bound = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    if g is not None:
        bound = bound + 2.0 * g.abs().float()
    if h is not None:
        bound = bound + 2.0 * h.abs().float() * logit_bound(x, weight, bias).float() / temperature
    return bound / temperature


def bucket(input, weight, *_args, **_):
    return tp.pow2_ceil(tp.rows(input)), (("v", tp.pow2_ceil(weight.shape[0])),)


def tune_points(n, hidden, vocab, dtype, device, args):
    """One point: random upstream gradients on both outputs (an RL loss's log-probs and an entropy bonus)."""
    shape, check = tp.lm_shape(n, hidden, vocab)
    x, w = tp.lm_head(n, hidden, vocab, dtype, device)
    upstream = (torch.randn(n, device=device), torch.randn(n, device=device))
    yield tp.Point("fused_linear_logprobs", shape,
                   tp.Inputs((x, w, tp.labels(n, vocab, device)), {}, [x, w], upstream), check)


OPS = (
    OpSpec(STATS_SCHEMA, "kernel", check_logprobs_stats, fake=fake_stats,
           summary="per-token log-probs / entropy: a logits slice's row stats (lse, z_target, mean z)"),
    OpSpec(GRAD_SCHEMA, "kernel", check_logprobs_grad, fake=fake_in_place,
           summary="per-token log-probs / entropy: the gradient over the logits from global stats"),
    OpSpec(USER_SCHEMA, "user", check_user_op, value_check=heads.target_classes,
           composed_of=("logprobs_stats", "logprobs_grad"), compose=FusedLinearLogProbs, probe=probe_user_op,
           differentiable=("input", "weight", "bias"), autocast=("input", "weight", "bias"), fake=fake_user_op,
           saved="Tensor stats, Tensor(a!) buffer", grads_in_saved=grads_in_saved,
           vocab_parallel=VocabParallel("weight", sliced={"weight": 0, "bias": 0},
                                        replicated={"input": False, "target": True}, kernel=vocab_parallel_kernels),
           tuning=tp.Tuning(bucket, tp.lm_head_groups(tune_points)),
           summary="fused linear per-token log-probs and entropy (RL / preference training), with autograd"),
)
BACKEND_MODULES = {"logprobs_stats": "logprobs", "logprobs_grad": "logprobs"}


# ---------------------------------------------------------------- conformance cases and samples (testing.py)
HEAD = ("input", "weight")
HEAD_BIAS = (*HEAD, "bias")


def _logprobs(ignored=(), bias=False, shape=None, all_ignored=False, vocab=None, scale=2.0, strided=False, **options):
    def build(m: Inputs):
        n = 8 if shape is not None else m.N
        v = m.V if vocab is None else vocab
        x = m.randn(n, m.H)
        target = m.labels(n, v, ignored=ignored, all_ignored=all_ignored, strided=strided)
        if shape is not None:  # [..., H] input, non-contiguous
            x, target = non_contiguous(x.view(*shape, m.H)), target.view(shape)
        inputs = dict(input=x, weight=m.weight(vocab=v, scale=scale), target=target)
        if bias:
            inputs["bias"] = m.randn(v)
        return inputs, options
    return build


def _empty(m: Inputs):
    x, w = empty_head(m)
    return empty_leaves(dict(input=x, weight=w, target=m.labels(0), bias=m.randn(m.V))), {}


CASES = {"fused_linear_logprobs": [
    Case("T0.7-both", _logprobs(ignored=(1, 4), temperature=0.7), HEAD, smoke=True, sample=True),
    Case("T1-bias", _logprobs(ignored=(0,), bias=True), HEAD_BIAS),
    Case("T2-no-entropy-grad", _logprobs(ignored=(2,), bias=True, temperature=2.0), HEAD_BIAS, used=(0,)),
    Case("entropy-grad-only", _logprobs(temperature=1.3), HEAD, used=(1,)),
    Case("all-ignored", _logprobs(bias=True, all_ignored=True), HEAD_BIAS),
    Case("strided-labels", _logprobs(ignored=(3,), strided=True, temperature=0.9), HEAD),
    Case("3d-noncontiguous", _logprobs(ignored=(0, 5), bias=True, shape=(2, 4), temperature=0.8), HEAD_BIAS),
    Case("fp16-tiny-upstream", _logprobs(ignored=(1,), bias=True, vocab=1031, scale=1.0), HEAD_BIAS,
         row_upstream=1e-5, dtypes=FP16),
    Case("fp16-cold-large-upstream", _logprobs(ignored=(1,), bias=True, scale=6.0, temperature=0.25), HEAD_BIAS,
         row_upstream=300.0, dtypes=FP16),
    Case("empty", _empty, kind="empty", extra_dtypes=FP16),
]}


def _grad_sample(m: Inputs):
    from liger_dispatch import dispatch

    logits, target = m.randn(6, 40, scale=4.0), sample_labels(m)
    stats = dispatch.op("logprobs_stats", backend="reference")(logits, target, temperature=1.5)
    grads = m.randn(6, dtype=torch.float32), m.randn(6, dtype=torch.float32)  # of the log-probs and the entropy
    return (logits, target, stats, *grads), dict(temperature=1.5)


SAMPLES = {
    "logprobs_stats": lambda m: ((m.randn(6, 40, scale=4.0), sample_labels(m)), dict(temperature=1.5)),
    "logprobs_grad": _grad_sample,
}
