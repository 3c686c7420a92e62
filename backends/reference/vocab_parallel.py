"""Reference vocab-parallel kernel-level ops (declared by the op families in registry/): the contract's formulas in eager torch.

Statistics and gradients in fp32 (float64 for float64 logits), the gradients written out analytically: a slice's
gradient depends on the global statistics, which autograd of a slice cannot see.
"""

import torch

from liger_dispatch import register_backend
from liger_dispatch.registry.cross_entropy import LSE, WEIGHT_SUM

from .formulas import compute_dtype, kl_sum, log_mixture, target_terms, valid_rows
from ._support import CAPABILITY, PRIORITY


def _register(op):
    return register_backend(op, backend="reference", priority=PRIORITY, capability=CAPABILITY)


def _rows(valid, values):
    """Per-row values (stacked as [C, k] when a list), 0 on ignored rows."""
    if isinstance(values, list):
        values = torch.stack(values, dim=1)
        valid = valid.unsqueeze(1)
    return torch.where(valid, values, 0.0)


def _write(logits, valid, grad, grad_scale, temperature=1.0):
    """logits <- grad_scale / temperature * grad, 0 on ignored rows."""
    if grad_scale is not None:
        grad = grad * grad_scale.to(grad.dtype).reshape(-1, 1)
    logits.copy_(torch.where(valid.unsqueeze(1), grad / temperature, 0.0))


def _widened(*tensors):
    """The tensors in the compute dtype."""
    dtype = compute_dtype(*tensors)
    return [t.to(dtype) for t in tensors]


def _softcapped(logits, softcap):
    """(z, tanh(logits / softcap) or None) in the compute dtype."""
    (z,) = _widened(logits)
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return softcap * t, t


def _target_in_slice(target, valid, vocab_start, width):
    """(column of the target inside this slice, 0 elsewhere; whether the row's target is in the slice)."""
    local = target - vocab_start
    inside = valid & (local >= 0) & (local < width)
    return torch.where(inside, local, 0), inside


def _slice_weights(ce_weight, vocab_start, width, like):
    """The class weights of this slice's columns in the compute dtype (1 without ce_weight)."""
    if ce_weight is None:
        return torch.ones(width, dtype=like.dtype, device=like.device)
    return ce_weight[vocab_start:vocab_start + width].to(like.dtype)


@_register("ce_vp_stats")
def ce_vp_stats(logits, target, *, vocab_start=0, ignore_index=-100, softcap=None, ce_weight=None):
    z, _ = _softcapped(logits, softcap)
    valid = target != ignore_index
    column, inside = _target_in_slice(target, valid, vocab_start, z.shape[1])
    z_target = z.gather(1, column.unsqueeze(1)).squeeze(1) if z.shape[1] else z.new_zeros(z.shape[0])
    w = _slice_weights(ce_weight, vocab_start, z.shape[1], z)
    z_max = z.amax(dim=1) if z.shape[1] else torch.full_like(z_target, float("-inf"))
    return _rows(valid, [torch.logsumexp(z, dim=1), z_max, torch.where(inside, z_target, 0.0), z @ w,
                         w.sum().expand_as(z_target)])


@_register("ce_vp_grad")
def ce_vp_grad(logits, target, stats, *, vocab_start=0, vocab_size=0, grad_scale=None, ignore_index=-100,
               label_smoothing=0.0, softcap=None, lse_square_scale=0.0, ce_weight=None):
    z, t = _softcapped(logits, softcap)
    stats = stats.to(z.dtype)
    lse = stats[:, LSE:LSE + 1]
    vocab = vocab_size or z.shape[1]
    valid = target != ignore_index
    eps = label_smoothing
    target_weight = torch.ones_like(lse) if ce_weight is None else \
        ce_weight.to(z.dtype)[torch.where(valid, target, 0)].unsqueeze(1)
    p_coef = (1.0 - eps) * target_weight + eps * stats[:, WEIGHT_SUM:WEIGHT_SUM + 1] / vocab + 2.0 * lse_square_scale * lse
    grad = p_coef * torch.exp(z - lse) - eps / vocab * _slice_weights(ce_weight, vocab_start, z.shape[1], z)
    column, inside = _target_in_slice(target, valid, vocab_start, z.shape[1])
    if z.shape[1]:
        on_target = torch.where(inside.unsqueeze(1), -(1.0 - eps) * target_weight, 0.0)
        grad.scatter_add_(1, column.unsqueeze(1), on_target)
    if t is not None:
        grad = grad * (1.0 - t * t)
    _write(logits, valid, grad, grad_scale)


@_register("jsd_vp_stats")
def jsd_vp_stats(student_logits, teacher_logits, labels=None, *, ignore_index=-100, temperature=1.0):
    s, t = (x / temperature for x in _widened(student_logits, teacher_logits))
    valid = valid_rows(labels, ignore_index, s.shape[0], s.device)
    return _rows(valid, [torch.logsumexp(s, dim=1), torch.logsumexp(t, dim=1)])


def _jsd_logs(student_logits, teacher_logits, lse, temperature):
    """(log q, log p) of this slice from the global log-sum-exps."""
    s, t = (x / temperature for x in _widened(student_logits, teacher_logits))
    lse = lse.to(s.dtype)
    return s - lse[:, :1], t - lse[:, 1:]


@_register("jsd_vp_sums")
def jsd_vp_sums(student_logits, teacher_logits, lse, labels=None, *, beta=0.5, ignore_index=-100, temperature=1.0):
    log_q, log_p = _jsd_logs(student_logits, teacher_logits, lse, temperature)
    valid = valid_rows(labels, ignore_index, log_q.shape[0], log_q.device)
    if beta == 0.0:
        loss = kl_sum(log_p, log_q)
        cross = torch.zeros_like(loss)
    elif beta == 1.0:
        loss = cross = kl_sum(log_q, log_p)
    else:
        log_m = log_mixture(log_p, log_q, beta)
        cross = kl_sum(log_q, log_m)
        loss = beta * kl_sum(log_p, log_m) + (1.0 - beta) * cross
    return _rows(valid, [loss, cross])


@_register("jsd_vp_grad")
def jsd_vp_grad(student_logits, teacher_logits, lse, sums, labels=None, *, beta=0.5, ignore_index=-100,
                temperature=1.0, grad_scale=None):
    log_q, log_p = _jsd_logs(student_logits, teacher_logits, lse, temperature)
    valid = valid_rows(labels, ignore_index, log_q.shape[0], log_q.device)
    q, cross = log_q.exp(), sums[:, 1:].to(log_q.dtype)
    if beta == 0.0:
        grad = q - log_p.exp()
    elif beta == 1.0:
        grad = q * (log_q - log_p - cross)
    else:
        grad = (1.0 - beta) * q * (log_q - log_mixture(log_p, log_q, beta) - cross)
    _write(student_logits, valid, grad, grad_scale, temperature)


@_register("kl_div_vp_stats")
def kl_div_vp_stats(student_logits, target, labels=None, *, ignore_index=-100, temperature=1.0, eps=1e-10,
                    log_target=False):
    s, target = _widened(student_logits, target)
    s = s / temperature
    q, q_log_q = target_terms(target, eps=eps, log_target=log_target)
    valid = valid_rows(labels, ignore_index, s.shape[0], s.device)
    return _rows(valid, [torch.logsumexp(s, dim=1), q.sum(dim=1), q_log_q.sum(dim=1), (q * s).sum(dim=1)])


@_register("kl_div_vp_grad")
def kl_div_vp_grad(student_logits, target, lse, target_sum, labels=None, *, ignore_index=-100, temperature=1.0,
                   log_target=False, grad_scale=None):
    s, target = _widened(student_logits, target)
    q = target.exp() if log_target else target
    valid = valid_rows(labels, ignore_index, s.shape[0], s.device)
    softmax = torch.exp(s / temperature - lse.to(s.dtype).unsqueeze(1))
    _write(student_logits, valid, softmax * target_sum.to(s.dtype).unsqueeze(1) - q, grad_scale, temperature)
