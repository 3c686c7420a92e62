"""The slice-and-combine check of a backend's vocab-parallel kernel-level ops (issue 11), without a process group.

A full-vocabulary [C, V] matrix is cut into column slices (uneven, possibly empty), each slice's statistics are
computed, combined as the driver does (log-sum-exp for lse columns, sums for the others), the gradient pass runs
on each slice in place, and the row losses and the concatenated gradient are what `kernel_checks.reference`
gives for the whole vocabulary.
"""

import torch

from kernel_checks import IGNORE

OPS = ("ce_vp_stats", "ce_vp_grad", "jsd_vp_stats", "jsd_vp_sums", "jsd_vp_grad", "kl_div_vp_stats", "kl_div_vp_grad")

# (start, stop) column slices of a vocabulary of V = 37 columns: one rank; three uneven ones, none a multiple of
# a block; an empty slice first.
ONE_RANK = ((0, 37),)
UNEVEN = ((0, 10), (10, 33), (33, 37))
WITH_EMPTY = ((0, 0), (0, 21), (21, 37))
SPLITS = {"one-rank": ONE_RANK, "uneven": UNEVEN, "with-empty": WITH_EMPTY}


def uneven(V):
    """An empty slice, then three uneven ones of a real vocabulary (V >= 64)."""
    a, b = V // 3 + 5, V - V // 5 - 3
    return (0, 0), (0, a), (a, b), (b, V)


def _slices(x, bounds):
    return [(start, x[:, start:stop]) for start, stop in bounds]


def _combine_lse(stats, column):
    return torch.logsumexp(torch.stack([s[:, column] for s in stats]), dim=0)


def _total(stats, column):
    return sum(s[:, column] for s in stats)


def run_ce(ops, x, target, bounds, *, grad_scale=None, label_smoothing=0.0, softcap=None, lse_square_scale=0.0):
    """Row losses of ops.ce_vp_stats + combine + ops.ce_vp_grad; x holds the gradient afterwards."""
    V = x.shape[1]
    vocab_size = 0 if len(bounds) == 1 else V  # 0: the slice is the whole vocabulary
    parts = _slices(x, bounds)
    stats = [ops.ce_vp_stats(xs, target, vocab_start=start, ignore_index=IGNORE, softcap=softcap)
             for start, xs in parts]
    lse = _combine_lse(stats, 0)
    eps = label_smoothing
    loss = (1 - eps) * (lse - _total(stats, 1)) + eps * (lse - _total(stats, 2) / V) + lse_square_scale * lse**2
    for start, xs in parts:
        ops.ce_vp_grad(xs, target, lse, vocab_start=start, vocab_size=vocab_size, grad_scale=grad_scale,
                       ignore_index=IGNORE, label_smoothing=label_smoothing, softcap=softcap,
                       lse_square_scale=lse_square_scale)
    return torch.where(target != IGNORE, loss, 0.0)


def run_jsd(ops, student, teacher, labels, bounds, *, beta, temperature=1.0, grad_scale=None):
    """Row losses of ops.jsd_vp_stats + combine + jsd_vp_sums + sum + jsd_vp_grad; student holds the gradient."""
    options = dict(ignore_index=IGNORE, temperature=temperature)
    parts = [(s, t) for (_, s), (_, t) in zip(_slices(student, bounds), _slices(teacher, bounds))]
    stats = [ops.jsd_vp_stats(s, t, labels, **options) for s, t in parts]
    lse = torch.stack([_combine_lse(stats, 0), _combine_lse(stats, 1)], dim=1)
    sums = sum(ops.jsd_vp_sums(s, t, lse, labels, beta=beta, **options) for s, t in parts)
    for s, t in parts:
        ops.jsd_vp_grad(s, t, lse, sums, labels, beta=beta, grad_scale=grad_scale, **options)
    return sums[:, 0]


def run_kl_div(ops, student, target, labels, bounds, *, temperature=1.0, log_target=False, grad_scale=None):
    """Row losses of ops.kl_div_vp_stats + combine + kl_div_vp_grad; student holds the gradient."""
    options = dict(ignore_index=IGNORE, temperature=temperature, log_target=log_target)
    parts = [(s, t) for (_, s), (_, t) in zip(_slices(student, bounds), _slices(target, bounds))]
    stats = [ops.kl_div_vp_stats(s, t, labels, **options) for s, t in parts]
    totals = sum(stats)
    lse = _combine_lse(stats, 0)
    for s, t in parts:
        ops.kl_div_vp_grad(s, t, lse, totals[:, 1], labels, grad_scale=grad_scale, **options)
    return totals[:, 2] - totals[:, 3] + lse * totals[:, 1]


def check_empty_slice(ops, device):
    """A slice with no columns: -inf log-sum-exp for rows not ignored, 0 elsewhere; the gradient passes are no-ops."""
    C = 3
    labels = torch.tensor([0, IGNORE, 2], device=device)
    empty = torch.empty(C, 0, device=device)
    inf = float("-inf")
    want = {
        "ce": ([[inf, 0, 0], [0, 0, 0], [inf, 0, 0]], ops.ce_vp_stats(empty, labels, vocab_start=5)),
        "jsd": ([[inf, inf], [0, 0], [inf, inf]], ops.jsd_vp_stats(empty, empty, labels)),
        "jsd unlabelled": ([[inf, inf]] * C, ops.jsd_vp_stats(empty, empty)),
        "kl": ([[inf, 0, 0, 0], [0, 0, 0, 0], [inf, 0, 0, 0]], ops.kl_div_vp_stats(empty, empty, labels)),
    }
    for name, (expected, got) in want.items():
        assert torch.equal(got.cpu(), torch.tensor(expected)), (name, got)
    rows = torch.zeros(C, device=device)
    assert torch.equal(ops.jsd_vp_sums(empty, empty, torch.zeros(C, 2, device=device), labels).cpu(),
                       torch.zeros(C, 2))
    ops.ce_vp_grad(empty, labels, rows, vocab_size=8)
    ops.jsd_vp_grad(empty, empty, torch.zeros(C, 2, device=device), torch.zeros(C, 2, device=device), labels)
    ops.kl_div_vp_grad(empty, empty, rows, rows, labels)
