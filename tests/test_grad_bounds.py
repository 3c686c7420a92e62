"""grad_bounds: each op's bound of a row's gradient L1 norm holds, on inputs built to make the gradient large."""

import pytest
import torch

from liger_dispatch.registry import cross_entropy, jsd, kl_div
from liger_dispatch.backends.reference.formulas import ce_rows, jsd_rows, kl_div_rows
from kernel_checks import reference

N, H, V = 16, 12, 37


def row_l1(rows_fn, logits):
    """sum_j |d loss_i / d logits_ij| per row, in float64."""
    return reference(rows_fn, logits)[1].abs().sum(-1)


def assert_bounded(got, bound):
    assert (got <= bound * (1 + 1e-9)).all(), f"max of gradient L1 / bound: {(got / bound).max():.6f}"


def head(logit_scale):
    x, w = torch.randn(N, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64) * logit_scale
    return x, w, x @ w.t()


@pytest.mark.parametrize("softcap,lse_square_scale,logit_scale", [(None, 0.0, 5.0), (30.0, 0.7, 5.0),
                                                                  (None, 0.7, 5.0), (None, 0.05, 0.1)])
def test_ce_bound(softcap, lse_square_scale, logit_scale):
    x, w, z = head(logit_scale)
    bias = torch.randn(V, dtype=torch.float64)
    y = torch.randint(0, V, (N,))
    options = dict(softcap=softcap, lse_square_scale=lse_square_scale)
    got = row_l1(lambda u: ce_rows(u, y, label_smoothing=0.3, **options), z + bias)
    assert_bounded(got, cross_entropy.grad_bound(x, w, bias, **options))


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.1, 1.0, 3.0])
def test_jsd_bound(beta, temperature):
    _, _, s = head(3.0)
    xt, wt, t = head(3.0)
    got = row_l1(lambda u: jsd_rows(u, t, None, beta=beta, temperature=temperature), s)
    assert_bounded(got, jsd.grad_bound(xt, wt, beta=beta, temperature=temperature))


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("temperature", [0.2, 1.0])
def test_kl_div_bound(log_target, temperature):
    _, _, s = head(3.0)
    target = torch.rand(N, V, dtype=torch.float64) * 3  # neither probabilities nor log-probabilities
    got = row_l1(lambda u: kl_div_rows(u, target, None, temperature=temperature, log_target=log_target), s)
    bound = kl_div.grad_bound(target, temperature=temperature, log_target=log_target)
    assert_bounded(got, bound)
    assert (got >= bound / (2 * V)).all()  # and not a wild one
