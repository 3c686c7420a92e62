"""The spec as plain eager PyTorch: per-row losses, the user-level ops, and the mHC coefficients.

Everything is autograd-friendly and computes in max(fp32, input dtype) from the logits on, so
float64 inputs stay float64 (gradcheck). Ignored rows give exactly 0 and a zero gradient.
Inputs are assumed valid: the registry checks them before any backend runs.
"""

import math

import torch
import torch.nn.functional as F

from liger_dispatch.registry.cross_entropy import CrossEntropyOutput


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or float64 when any input is float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def valid_rows(labels, ignore_index, n_rows, device):
    if labels is None:
        return torch.ones(n_rows, dtype=torch.bool, device=device)
    return labels != ignore_index


# ---------------------------------------------------------------- per-row losses from logits


def _ce_terms(logits, target, ignore_index, softcap):
    """(z softcapped, rows not ignored, lse, z_target) of logits [C, V] in the compute dtype."""
    z = logits.to(compute_dtype(logits))
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = target != ignore_index
    z_target = z.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    return z, valid, torch.logsumexp(z, dim=-1), z_target


def ce_rows(logits, target, *, ignore_index=-100, label_smoothing=0.0, softcap=None, lse_square_scale=0.0,
            ce_weight=None):
    """Cross-entropy per row of logits [C, V], with class weights w = ce_weight (1 without):
    (1-eps) w_y (lse - z_y) + eps / V sum_j w_j (lse - z_j) + scale * lse^2 (unweighted: eps (lse - mean z))."""
    z, valid, lse, z_target = _ce_terms(logits, target, ignore_index, softcap)
    loss = (1.0 - label_smoothing) * (lse - z_target)
    if ce_weight is not None:
        w = ce_weight.to(z.dtype)
        loss = loss * w[torch.where(valid, target, 0)]
    if label_smoothing != 0.0:
        smooth = lse - z.mean(dim=-1) if ce_weight is None else ((lse.unsqueeze(-1) - z) * w).mean(dim=-1)
        loss = loss + label_smoothing * smooth
    if lse_square_scale != 0.0:
        loss = loss + lse_square_scale * lse.square()
    return torch.where(valid, loss, 0.0)


def ce_row_stats(logits, target, *, ignore_index=-100, softcap=None):
    """[C, 2] per row of logits [C, V]: (lse, 1 where the target's logit is the row's max else 0), 0 where ignored.
    A target tied with another class for the max counts as predicted (argmax would take the first of them)."""
    z, valid, lse, z_target = _ce_terms(logits, target, ignore_index, softcap)
    correct = valid & (z_target >= z.amax(dim=-1))
    return torch.stack([torch.where(valid, lse, 0.0), correct.to(lse.dtype)], dim=-1)


def jsd_rows(student_logits, teacher_logits, labels, *, beta, ignore_index=-100, temperature=1.0):
    """Generalized JSD per row; beta=0 is KL(p||q), beta=1 is KL(q||p) (q student, p teacher)."""
    dtype = compute_dtype(student_logits, teacher_logits)
    log_q = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    log_p = torch.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    if beta == 0.0:
        loss = kl_sum(log_p, log_q)
    elif beta == 1.0:
        loss = kl_sum(log_q, log_p)
    else:
        log_m = log_mixture(log_p, log_q, beta)
        loss = beta * kl_sum(log_p, log_m) + (1.0 - beta) * kl_sum(log_q, log_m)
    valid = valid_rows(labels, ignore_index, loss.shape[0], loss.device)
    return torch.where(valid, loss, 0.0)


def kl_sum(log_a, log_b):
    """KL(a||b) per row from finite log-probabilities (of a slice of the vocabulary: its part of the sum)."""
    return (log_a.exp() * (log_a - log_b)).sum(dim=-1)


def log_mixture(log_p, log_q, beta):
    """log m = log(beta p + (1-beta) q) without leaving log space, 0 < beta < 1."""
    return torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))


def target_log(target, *, eps, log_target):
    """(q, log q) elementwise from KL targets (benchmarks/kl_semantics.md).

    Probabilities: log q = log(max(q, eps)), and NaN for a negative q (its row's loss is NaN, as torch's).
    Log-probabilities (log_target): q = exp(target) and log q = target itself, eps unused; -inf is q = 0.
    """
    if log_target:
        return target.exp(), target
    return target, torch.where(target < 0, float("nan"), torch.log(target.clamp_min(eps)))


def target_terms(target, *, eps, log_target):
    """(q, q log q) elementwise from KL targets; 0 log 0 = 0 (also for eps = 0 and a log-target of -inf)."""
    q, log_q = target_log(target, eps=eps, log_target=log_target)
    return q, torch.where(q == 0, 0.0, q * log_q)


def kl_div_rows(student_logits, target, labels, *, ignore_index=-100, temperature=1.0, eps=1e-10, log_target=False):
    """KL(target || softmax(student/T)) per row: sum_j q_j (log q_j - log_softmax_j), 0 log 0 = 0.

    Probabilities: log q = log(max(q, eps)); a negative one makes the row NaN (torch's kl_div: NaN), its gradient
    stays softmax * sum q - q (torch's too). Log-probabilities (log_target): q = exp(target) and log q = target
    itself, eps unused (as torch.nn.functional.kl_div(log_target=True)), except that -inf is q = 0 and adds 0
    (torch: 0 * -inf = NaN). Each term is q (log q - log softmax), one product: q log q - q log softmax would
    cancel between two terms of size q |log q| when log q is close to log softmax.
    """
    dtype = compute_dtype(student_logits, target)
    log_s = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    q, log_q = target_log(target.detach().to(dtype), eps=eps, log_target=log_target)
    loss = torch.where(q == 0, 0.0, q * (log_q - log_s)).sum(dim=-1)
    valid = valid_rows(labels, ignore_index, loss.shape[0], loss.device)
    return torch.where(valid, loss, 0.0)


# ---------------------------------------------------------------- per-token log-probs and entropy


def logprobs_rows(logits, target, *, temperature=1.0, ignore_index=-100):
    """(logprobs, entropy) per row of logits [C, V], the spec: with z = logits / T and lp = log_softmax(z),
    logprobs = lp[target] and entropy = -sum_j p_j lp_j. Ignored rows: 0 in both, no gradient.

    With upstream gradients g (on logprobs) and h (on entropy), the gradient over the logits is
        d/d logits_j = (g (1[j = target] - p_j) - h p_j (lp_j + entropy)) / T,
    lp_j + entropy = z_j - mean with mean = sum_k p_k z_k (logprobs_grad computes it from the statistics); through
    the head z = (x W^T + b) / T: dX = dz W, dW = dz^T X, db = sum_rows dz."""
    z = logits.to(compute_dtype(logits)) / temperature
    valid = target != ignore_index
    lp = torch.log_softmax(z, dim=-1)
    logprobs = lp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(lp.exp() * lp).sum(dim=-1)
    return torch.where(valid, logprobs, 0.0), torch.where(valid, entropy, 0.0)


def logprobs_stats(logits, target, *, vocab_start=0, temperature=1.0, ignore_index=-100):
    """[C, 3] per row of a slice [C, Vl] of the vocabulary's columns [vocab_start, vocab_start + Vl):
    (lse = logsumexp z, z_target = z[target - vocab_start] if the target is in this slice else 0,
    mean = sum_j softmax(z)_j z_j under this slice's own softmax). Ignored rows: all 0; an empty slice: lse -inf."""
    z = logits.to(compute_dtype(logits)) / temperature
    valid = target != ignore_index
    local = target - vocab_start
    inside = valid & (local >= 0) & (local < z.shape[1])
    if z.shape[1]:
        z_target = z.gather(1, torch.where(inside, local, 0).unsqueeze(1)).squeeze(1)
    else:
        z_target = z.new_zeros(z.shape[0])
    lse = torch.logsumexp(z, dim=1)  # -inf for an empty slice
    mean = (torch.softmax(z, dim=1) * z).sum(dim=1)  # 0 for an empty slice
    stats = torch.stack([lse, torch.where(inside, z_target, 0.0), mean], dim=1)
    return torch.where(valid.unsqueeze(1), stats, 0.0)


def combine_logprobs_stats(stats):
    """The whole vocabulary's [C, 3] statistics from its slices' [R, C, 3] (see logprobs_stats): lse = logsumexp_r
    lse_r, z_target = sum_r z_target_r, mean = sum_r exp(lse_r - lse) mean_r. An empty slice (lse_r = -inf)
    weighs 0."""
    lse = torch.logsumexp(stats[..., 0], dim=0)
    weights = torch.exp(stats[..., 0] - lse)
    mean = (weights * stats[..., 2]).sum(dim=0)
    return torch.stack([lse, stats[..., 1].sum(dim=0), mean], dim=1)


def logprobs_from_stats(stats, target, *, ignore_index=-100):
    """(logprobs, entropy) per row from the whole vocabulary's statistics [C, 3]: (z_target - lse, lse - mean), 0 on
    ignored rows (combined over R > 1 slices their zero statistics come out as (log R, 0, 0), so they are masked)."""
    lse, z_target, mean = stats.unbind(dim=1)
    valid = target != ignore_index
    return torch.where(valid, z_target - lse, 0.0), torch.where(valid, lse - mean, 0.0)


def logprobs_grad(logits, target, stats, grad_logprobs=None, grad_entropy=None, *, vocab_start=0, temperature=1.0,
                  ignore_index=-100):
    """The closed-form d(sum_i g_i logprobs_i + h_i entropy_i) / d logits of a slice [C, Vl] from the whole
    vocabulary's statistics [C, 3], in the compute dtype: with p_j = exp(z_j - lse),
        (g (1[j + vocab_start == target] - p_j) - h p_j (z_j - mean)) / T.
    g, h: [C], None is 0. Ignored rows: 0."""
    z = logits.to(compute_dtype(logits)) / temperature
    stats = stats.to(z.dtype)
    lse, mean = stats[:, :1], stats[:, 2:]
    valid = target != ignore_index
    p = torch.exp(z - lse)
    grad = torch.zeros_like(z)
    if grad_logprobs is not None:
        g = grad_logprobs.to(z.dtype).unsqueeze(1)
        local = target - vocab_start
        columns = torch.arange(z.shape[1], device=z.device)
        grad = grad + g * ((columns == local.unsqueeze(1)).to(z.dtype) - p)
    if grad_entropy is not None:
        grad = grad - grad_entropy.to(z.dtype).unsqueeze(1) * p * (z - mean)
    return torch.where(valid.unsqueeze(1), grad / temperature, 0.0)


# ---------------------------------------------------------------- user-level eager ops


def _mean_over_valid(total, valid, per_row_count=1):
    return total / (valid.sum() * per_row_count).clamp_min(1)


def _over(total, denominator):
    """total / denominator, 0 where the denominator is 0 (a mean over nothing), gradients included."""
    nonzero = denominator != 0
    return torch.where(nonzero, total / torch.where(nonzero, denominator, 1), 0.0)


def _reduced(rows, reduction, denominator):
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    if reduction == "mean":
        return _over(rows.sum(), denominator)
    raise ValueError(f"flce: unknown reduction {reduction!r}")


def flce(input, weight, target, bias=None, ce_weight=None, *, ignore_index=-100, reduction="mean",
         label_smoothing=0.0, softcap=None, lse_square_scale=0.0, return_z_loss=False, return_token_accuracy=False):
    """The loss as torch's F.cross_entropy(weight=ce_weight, label_smoothing=) computes it (a mean divides by the
    sum of the target weights), plus the z-loss lse_square_scale lse^2, which no class weight scales (a mean
    divides it by the number of rows not ignored); with return_z_loss / return_token_accuracy a
    CrossEntropyOutput that also holds the z-loss and the fraction of rows whose target's logit is the max."""
    logits = F.linear(input.reshape(-1, input.shape[-1]), weight, bias)
    flat = target.reshape(-1)
    ce = ce_rows(logits, flat, ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap,
                 ce_weight=ce_weight)
    lse, correct = ce_row_stats(logits, flat, ignore_index=ignore_index, softcap=softcap).unbind(-1)
    valid = flat != ignore_index
    count = valid.sum().to(ce.dtype)
    weights = torch.ones_like(ce) if ce_weight is None else ce_weight.to(ce.dtype)[torch.where(valid, flat, 0)]
    z_loss = _reduced(lse_square_scale * lse.square(), reduction, count)
    loss = _reduced(ce, reduction, torch.where(valid, weights, 0.0).sum()) + z_loss
    accuracy = _reduced(correct.detach(), "none" if reduction == "none" else "mean", count)
    if reduction == "none":
        loss, z_loss, accuracy = (t.reshape(target.shape) for t in (loss, z_loss, accuracy))
    if not (return_z_loss or return_token_accuracy):
        return loss
    return CrossEntropyOutput(loss, z_loss if return_z_loss else None, accuracy if return_token_accuracy else None)


fused_linear_cross_entropy = flce


def fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None, *,
                     jsd_beta=0.5, ignore_index=-100, temperature=1.0, scale_by_temperature_squared=False):
    hidden = student_input.shape[-1]
    student_logits = student_input.reshape(-1, hidden) @ student_weight.T
    with torch.no_grad():
        teacher_logits = teacher_input.reshape(-1, teacher_input.shape[-1]) @ teacher_weight.T
    labels = None if shift_labels is None else shift_labels.reshape(-1)
    rows = jsd_rows(student_logits, teacher_logits, labels, beta=jsd_beta, ignore_index=ignore_index,
                    temperature=temperature)
    loss = _mean_over_valid(rows.sum(), valid_rows(labels, ignore_index, rows.shape[0], rows.device))
    return loss * temperature**2 if scale_by_temperature_squared else loss


def fused_linear_kl_div(student_input, student_weight, target, shift_labels=None, *, reduction="batchmean",
                        ignore_index=-100, temperature=1.0, eps=1e-10, log_target=False):
    student_logits = student_input.reshape(-1, student_input.shape[-1]) @ student_weight.T
    vocab = student_logits.shape[-1]
    labels = None if shift_labels is None else shift_labels.reshape(-1)
    rows = kl_div_rows(student_logits, target.reshape(-1, vocab), labels, ignore_index=ignore_index,
                       temperature=temperature, eps=eps, log_target=log_target)
    valid = valid_rows(labels, ignore_index, rows.shape[0], rows.device)
    if reduction == "batchmean":
        return _mean_over_valid(rows.sum(), valid)
    if reduction == "mean":
        return _mean_over_valid(rows.sum(), valid, per_row_count=vocab)
    if reduction == "sum":
        return rows.sum()
    raise ValueError(f"fused_linear_kl_div: unknown reduction {reduction!r} (\"none\" is not supported)")


def fused_linear_logprobs(input, weight, target, bias=None, *, temperature=1.0, ignore_index=-100):
    """(logprobs, entropy) of the LM head input @ weight.T + bias for the given tokens, the target's shape."""
    logits = F.linear(input.reshape(-1, input.shape[-1]), weight, bias)
    logprobs, entropy = logprobs_rows(logits, target.reshape(-1), temperature=temperature, ignore_index=ignore_index)
    return logprobs.reshape(target.shape), entropy.reshape(target.shape)


# ---------------------------------------------------------------- mHC coefficients


def mhc_mix(x, phi, *, rms_eps=1e-6):
    """x [M, K] -> (mix [M, n], rstd [M]): mix = (x @ phi) * rsqrt(mean(x^2) + rms_eps), all in fp32 or wider."""
    dtype = compute_dtype(x, phi)
    x = x.to(dtype)
    rstd = torch.rsqrt(x.square().mean(dim=-1) + rms_eps)
    return (x @ phi.to(dtype)) * rstd.unsqueeze(-1), rstd


def mhc_coeffs_from_mix(mix, b, alpha_pre, alpha_post, alpha_res, *, hc, tmax=20, pre_eps=0.0,
                        sinkhorn_eps=1e-6, post_mult=2.0):
    """mix [M, n] -> (h_pre [M, hc], h_post [M, hc], h_res [M, hc, hc])."""
    h_pre = torch.sigmoid(mix[:, :hc] * alpha_pre + b[:hc]) + pre_eps
    h_post = torch.sigmoid(mix[:, hc:2 * hc] * alpha_post + b[hc:2 * hc]) * post_mult
    logits = (mix[:, 2 * hc:] * alpha_res + b[2 * hc:]).reshape(-1, hc, hc)
    h_res = sinkhorn(logits, tmax=tmax, eps=sinkhorn_eps)
    return h_pre, h_post, h_res


def sinkhorn(logits, *, tmax, eps):
    """Row softmax + eps, normalize columns, then tmax-1 rounds of rows-then-columns normalization."""
    p = torch.softmax(logits, dim=-1) + eps
    p = p / (p.sum(dim=-2, keepdim=True) + eps)
    for _ in range(tmax - 1):
        p = p / (p.sum(dim=-1, keepdim=True) + eps)
        p = p / (p.sum(dim=-2, keepdim=True) + eps)
    return p


def mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, *, tmax=20, rms_eps=1e-6, pre_eps=0.0,
               sinkhorn_eps=1e-6, post_mult=2.0):
    """x [..., HC, C] -> (h_pre [..., HC], h_post [..., HC], h_res [..., HC, HC]) in fp32 (float64 stays)."""
    *lead, hc, channels = x.shape
    mix, _ = mhc_mix(x.reshape(-1, hc * channels), phi, rms_eps=rms_eps)
    h_pre, h_post, h_res = mhc_coeffs_from_mix(mix, b, alpha_pre, alpha_post, alpha_res, hc=hc, tmax=tmax,
                                               pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps, post_mult=post_mult)
    return h_pre.reshape(*lead, hc), h_post.reshape(*lead, hc), h_res.reshape(*lead, hc, hc)
