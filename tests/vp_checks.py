"""The empty-slice check of a backend's vocab-parallel kernel-level ops, shared by the registry-driven
suite (tests/test_vocab_parallel_kernels.py) and the CuTeDSL one, which runs it on the CPU with every compile
cache poisoned: an empty slice must launch nothing."""

import torch

from kernel_checks import IGNORE


def check_empty_slice(op, device):
    """op(name) -> the callable of that vocab-parallel op. A slice with no columns: -inf log-sum-exp for rows not
    ignored, 0 elsewhere; the gradient passes are no-ops."""
    C = 3
    labels = torch.tensor([0, IGNORE, 2], device=device)
    empty = torch.empty(C, 0, device=device)
    pair = torch.zeros(C, 2, device=device)
    inf = float("-inf")
    want = {
        "ce": ([[inf, inf, 0, 0, 0], [0, 0, 0, 0, 0], [inf, inf, 0, 0, 0]],
               op("ce_vp_stats")(empty, labels, vocab_start=5)),
        "jsd": ([[inf, inf], [0, 0], [inf, inf]], op("jsd_vp_stats")(empty, empty, labels)),
        "jsd unlabelled": ([[inf, inf]] * C, op("jsd_vp_stats")(empty, empty)),
        "kl": ([[inf, 0, 0, 0], [0, 0, 0, 0], [inf, 0, 0, 0]], op("kl_div_vp_stats")(empty, empty, labels)),
        "jsd sums": ([[0, 0]] * C, op("jsd_vp_sums")(empty, empty, pair, labels)),
    }
    for name, (expected, got) in want.items():
        assert torch.equal(got.cpu(), torch.tensor(expected)), (name, got)
    rows = torch.zeros(C, device=device)
    op("ce_vp_grad")(empty, labels, torch.zeros(C, 5, device=device), vocab_size=8)
    op("jsd_vp_grad")(empty, empty, pair, pair, labels)
    op("kl_div_vp_grad")(empty, empty, rows, rows, labels)
