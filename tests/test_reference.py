"""The reference backend is the spec: its formulas against independent float64 math, gradcheck on every
user-level op and option, and its kernel-level ops against the formulas."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from kernel_checks import GRAD_SCALE_FORMS, reference
from kernel_checks import grad_scale as grad_scale_of
from liger_dispatch.backends.reference import ce, formulas, jsd, kl_div, mhc

F64 = torch.float64
IGNORE = -100
N, H, V = 5, 3, 7  # gradcheck shapes


def randn(*shape, dtype=F64, scale=1.0, requires_grad=False):
    return (torch.randn(shape, dtype=dtype) * scale).requires_grad_(requires_grad)


def labels(n, vocab, *, ignored=(1,)):
    out = torch.randint(0, vocab, (n,))
    out[list(ignored)] = IGNORE
    return out


def finite(*tensors):
    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


# ---------------------------------------------------------------- formulas vs independent float64


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("lse_square_scale", [0.0, 0.05])
def test_ce_rows_match_torch_cross_entropy(softcap, label_smoothing, lse_square_scale):
    logits, target = randn(6, 11, scale=4.0), labels(6, 11, ignored=(0, 4))
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    expected = F.cross_entropy(z, target, ignore_index=IGNORE, label_smoothing=label_smoothing, reduction="none")
    expected = expected + (target != IGNORE) * lse_square_scale * torch.logsumexp(z, dim=-1) ** 2
    got = formulas.ce_rows(logits, target, ignore_index=IGNORE, label_smoothing=label_smoothing, softcap=softcap,
                           lse_square_scale=lse_square_scale)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_jsd_rows_match_probability_space_math(beta, temperature):
    student, teacher, lab = randn(6, 11, scale=3.0), randn(6, 11, scale=3.0), labels(6, 11, ignored=(2,))
    q, p = torch.softmax(student / temperature, -1), torch.softmax(teacher / temperature, -1)
    m = beta * p + (1 - beta) * q
    # F.kl_div(log a, b) = KL(b || a). The endpoints are the plain KLs, not the limits of the mixture (which are 0).
    if beta == 0.0:
        expected = F.kl_div(q.log(), p, reduction="none")
    elif beta == 1.0:
        expected = F.kl_div(p.log(), q, reduction="none")
    else:
        expected = beta * F.kl_div(m.log(), p, reduction="none") + (1 - beta) * F.kl_div(m.log(), q, reduction="none")
    expected = expected.sum(-1) * (lab != IGNORE)
    got = formulas.jsd_rows(student, teacher, lab, beta=beta, ignore_index=IGNORE, temperature=temperature)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kl_rows_match_torch_kl_div(log_target, temperature):
    student, lab = randn(6, 11, scale=3.0), labels(6, 11, ignored=(3,))
    probs = torch.softmax(randn(6, 11, scale=2.0), -1)
    if not log_target:
        probs[0, :4] = 0.0  # 0 * log 0 = 0
    target = probs.log() if log_target else probs
    log_s = torch.log_softmax(student / temperature, -1)
    expected = F.kl_div(log_s, target, reduction="none", log_target=log_target).sum(-1) * (lab != IGNORE)
    got = formulas.kl_div_rows(student, target, lab, ignore_index=IGNORE, temperature=temperature,
                               log_target=log_target)
    torch.testing.assert_close(got, expected)


def test_kl_rows_clamp_target_log_at_eps():
    student, eps = randn(4, 9), 1e-3
    target = torch.rand(4, 9, dtype=F64) * 4e-3  # straddles eps
    target[:, 0] = 0.0
    log_s = torch.log_softmax(student, -1)
    expected = torch.tensor([
        sum(q * (math.log(max(q, eps)) - ls) for q, ls in zip(q_row, ls_row))
        for q_row, ls_row in zip(target.tolist(), log_s.tolist())
    ], dtype=F64)
    got = formulas.kl_div_rows(student, target, None, eps=eps)
    torch.testing.assert_close(got, expected)


def test_kl_rows_log_target_minus_inf_contributes_zero():
    student, target = randn(3, 6), torch.log_softmax(randn(3, 6), -1)
    target[:, 2] = -math.inf
    got = formulas.kl_div_rows(student.requires_grad_(), target, None, log_target=True)
    (grad,) = torch.autograd.grad(got.sum(), student)
    keep = [0, 1, 3, 4, 5]
    log_s = torch.log_softmax(student.detach(), -1)[:, keep]
    expected = (target[:, keep].exp() * (target[:, keep] - log_s)).sum(-1)
    torch.testing.assert_close(got.detach(), expected)
    assert finite(got, grad)


def mhc_independent(x, phi, b, a_pre, a_post, a_res, *, tmax, rms_eps, pre_eps, sinkhorn_eps, post_mult):
    """Float64, written out: RMS, projection, sigmoids and an explicit Sinkhorn on each HC x HC block."""
    *lead, hc, c = x.shape
    rows = x.reshape(-1, hc * c).double()
    r = 1.0 / torch.sqrt((rows * rows).sum(1) / (hc * c) + rms_eps)
    mix = torch.einsum("mk,kn->mn", rows, phi.double()) * r[:, None]
    h_pre = 1.0 / (1.0 + torch.exp(-(mix[:, :hc] * a_pre + b[:hc]))) + pre_eps
    h_post = post_mult / (1.0 + torch.exp(-(mix[:, hc:2 * hc] * a_post + b[hc:2 * hc])))
    blocks = []
    for row in mix[:, 2 * hc:] * a_res + b[2 * hc:]:
        e = torch.exp(row.reshape(hc, hc))
        p = e / e.sum(1, keepdim=True) + sinkhorn_eps
        for it in range(tmax):
            if it:
                p = p / (p.sum(1, keepdim=True) + sinkhorn_eps)
            p = p / (p.sum(0, keepdim=True) + sinkhorn_eps)
        blocks.append(p)
    return h_pre.reshape(*lead, hc), h_post.reshape(*lead, hc), torch.stack(blocks).reshape(*lead, hc, hc)


def mhc_inputs(hc, c=3, lead=(2, 3), dtype=F64, requires_grad=False):
    n = hc * hc + 2 * hc
    x = randn(*lead, hc, c, dtype=dtype, requires_grad=requires_grad)
    phi = randn(hc * c, n, dtype=dtype, scale=0.5, requires_grad=requires_grad)
    b = randn(n, dtype=F64 if dtype == F64 else torch.float32, scale=0.5, requires_grad=requires_grad)
    alphas = [(randn(dtype=b.dtype).abs() + 0.5).requires_grad_(requires_grad) for _ in range(3)]
    return x, phi, b, *alphas


MHC_OPTIONS = dict(rms_eps=1e-6, pre_eps=0.01, sinkhorn_eps=1e-6, post_mult=2.0)


@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize("tmax", [1, 3, 20])
def test_mhc_coeffs_match_independent(hc, tmax):
    args = mhc_inputs(hc)
    got = formulas.mhc_coeffs(*args, tmax=tmax, **MHC_OPTIONS)
    expected = mhc_independent(*args, tmax=tmax, **MHC_OPTIONS)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_mhc_sinkhorn_converges_to_doubly_stochastic():
    _, _, h_res = formulas.mhc_coeffs(*mhc_inputs(4, dtype=torch.float32), tmax=200)
    assert h_res.dtype == torch.float32
    for sums in (h_res.sum(-2), h_res.sum(-1)):
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-3, rtol=0)


# ---------------------------------------------------------------- user-level ops vs independent float64


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_flce_matches_torch(reduction):
    x, w, bias = randn(2, 3, H), randn(V, H), randn(V)
    target = labels(6, V, ignored=(1, 4)).reshape(2, 3)
    expected = F.cross_entropy(F.linear(x, w, bias).reshape(-1, V), target.reshape(-1), ignore_index=IGNORE,
                               label_smoothing=0.1, reduction=reduction)
    got = formulas.flce(x, w, target, bias, reduction=reduction, label_smoothing=0.1)
    torch.testing.assert_close(got, expected.reshape(target.shape) if reduction == "none" else expected)


@pytest.mark.parametrize("scale_t2", [False, True])
def test_fused_linear_jsd_is_the_mean_over_valid_rows(scale_t2):
    sx, sw, tx, tw = randn(2, 3, H), randn(V, H), randn(2, 3, H), randn(V, H)
    lab, t = labels(6, V, ignored=(0, 5)), 2.0
    rows = formulas.jsd_rows(sx.reshape(-1, H) @ sw.T, tx.reshape(-1, H) @ tw.T, lab, beta=0.4, temperature=t)
    expected = rows.sum() / 4 * (t * t if scale_t2 else 1.0)
    got = formulas.fused_linear_jsd(sx, sw, tx, tw, lab.reshape(2, 3), jsd_beta=0.4, temperature=t,
                                    scale_by_temperature_squared=scale_t2)
    torch.testing.assert_close(got, expected)


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")
@pytest.mark.parametrize("reduction", ["batchmean", "mean", "sum"])
def test_fused_linear_kl_div_matches_torch(reduction):
    x, w = randn(2, 3, H), randn(V, H)
    target = torch.softmax(randn(2, 3, V), -1)
    log_s = torch.log_softmax((x @ w.T).reshape(-1, V), -1)
    expected = F.kl_div(log_s, target.reshape(-1, V), reduction=reduction)
    torch.testing.assert_close(formulas.fused_linear_kl_div(x, w, target, reduction=reduction), expected)


def test_fused_linear_kl_div_rejects_reduction_none():
    x, w = randn(2, H), randn(V, H)
    with pytest.raises(ValueError, match="none"):
        formulas.fused_linear_kl_div(x, w, torch.softmax(randn(2, V), -1), reduction="none")


def test_teacher_and_target_are_not_differentiated():
    sx, sw = randn(N, H, requires_grad=True), randn(V, H, requires_grad=True)
    tx, tw = randn(N, H, requires_grad=True), randn(V, H, requires_grad=True)
    target = torch.softmax(randn(N, V), -1).requires_grad_()
    jsd_loss = formulas.fused_linear_jsd(sx, sw, tx, tw)
    kl_loss = formulas.fused_linear_kl_div(sx, sw, target)
    assert torch.autograd.grad(jsd_loss, (tx, tw), allow_unused=True) == (None, None)
    assert torch.autograd.grad(kl_loss, target, allow_unused=True) == (None,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_give_fp32_loss(dtype):
    x, w, target = randn(N, H, dtype=dtype), randn(V, H, dtype=dtype), labels(N, V)
    loss = formulas.flce(x, w, target)
    expected = F.cross_entropy((x @ w.T).float(), target, ignore_index=IGNORE)  # GEMM rounds to dtype, then fp32
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected)


# ---------------------------------------------------------------- gradcheck, float64


CE_OPTIONS = [
    {},
    {"bias": True},
    {"softcap": 2.0},
    {"label_smoothing": 0.15},
    {"lse_square_scale": 0.1},
    {"bias": True, "softcap": 1.5, "label_smoothing": 0.1, "lse_square_scale": 0.05, "ignore_index": 2},
]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", CE_OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_gradcheck_flce(reduction, options):
    options = dict(options)
    use_bias = options.pop("bias", False)
    ignore_index = options.setdefault("ignore_index", IGNORE)
    x, w = randn(N, H, requires_grad=True), randn(V, H, scale=2.0, requires_grad=True)
    bias = randn(V, requires_grad=True) if use_bias else None
    target = labels(N, V, ignored=(1,))
    target[target == IGNORE] = ignore_index
    inputs = (x, w) if bias is None else (x, w, bias)
    assert gradcheck(lambda *a: formulas.flce(*a[:2], target, *a[2:], reduction=reduction, **options), inputs)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature,scale_t2", [(1.0, False), (2.0, False), (0.5, True)])
@pytest.mark.parametrize("with_labels", [False, True])
def test_gradcheck_fused_linear_jsd(beta, temperature, scale_t2, with_labels):
    sx, sw = randn(N, H, requires_grad=True), randn(V, H, scale=2.0, requires_grad=True)
    tx, tw = randn(N, H), randn(V, H, scale=2.0)
    lab = labels(N, V, ignored=(0, 3)) if with_labels else None
    assert gradcheck(
        lambda a, b: formulas.fused_linear_jsd(a, b, tx, tw, lab, jsd_beta=beta, temperature=temperature,
                                               scale_by_temperature_squared=scale_t2),
        (sx, sw),
    )


@pytest.mark.parametrize("reduction", ["batchmean", "mean", "sum"])
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_gradcheck_fused_linear_kl_div(reduction, log_target, temperature):
    sx, sw = randn(N, H, requires_grad=True), randn(V, H, scale=2.0, requires_grad=True)
    probs = torch.softmax(randn(N, V, scale=2.0), -1)
    target = probs.log() if log_target else probs
    lab = labels(N, V, ignored=(2,))
    assert gradcheck(
        lambda a, b: formulas.fused_linear_kl_div(a, b, target, lab, reduction=reduction, temperature=temperature,
                                                  log_target=log_target),
        (sx, sw),
    )


@pytest.mark.parametrize("eps", [1e-3, 0.0])
def test_gradcheck_fused_linear_kl_div_eps_and_zero_targets(eps):
    sx, sw = randn(N, H, requires_grad=True), randn(V, H, requires_grad=True)
    target = torch.softmax(randn(N, V), -1)
    target[:, 0] = 0.0
    target[:, 1] = 1e-4  # below eps=1e-3: its log is clamped
    assert finite(formulas.fused_linear_kl_div(sx, sw, target, eps=eps))
    assert gradcheck(lambda a, b: formulas.fused_linear_kl_div(a, b, target, eps=eps), (sx, sw))


@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize("tmax", [1, 3])
def test_gradcheck_mhc_coeffs(hc, tmax):
    args = mhc_inputs(hc, c=2, lead=(3,), requires_grad=True)
    options = dict(MHC_OPTIONS, pre_eps=0.1, post_mult=1.5)
    assert gradcheck(lambda *a: formulas.mhc_coeffs(*a, tmax=tmax, **options), args)


def test_all_rows_ignored_gives_zero_loss_and_zero_grads():
    sx, sw, bias = randn(N, H, requires_grad=True), randn(V, H, requires_grad=True), randn(V, requires_grad=True)
    tx, tw = randn(N, H), randn(V, H)
    ignored = torch.full((N,), IGNORE)
    target = torch.softmax(randn(N, V), -1)
    losses = [formulas.flce(sx, sw, ignored, bias, reduction=r, label_smoothing=0.1, softcap=2.0,
                            lse_square_scale=0.1) for r in ("mean", "sum", "none")]
    losses += [formulas.fused_linear_jsd(sx, sw, tx, tw, ignored, jsd_beta=b, scale_by_temperature_squared=True,
                                         temperature=2.0) for b in (0.0, 0.5, 1.0)]
    losses += [formulas.fused_linear_kl_div(sx, sw, t, ignored, reduction=r, log_target=lt)
               for r in ("batchmean", "mean", "sum") for lt, t in ((False, target), (True, target.log()))]
    for loss in losses:
        grads = torch.autograd.grad(loss.sum(), (sx, sw, bias), allow_unused=True)
        assert finite(loss, *grads)
        assert not loss.any()
        assert all(g is None or not g.any() for g in grads)


# ---------------------------------------------------------------- kernel-level ops vs the formulas


def logits_buffer(c, v, dtype, pad=3):
    """[c, v] logits with row stride v + pad; the padding columns hold a sentinel."""
    wide = torch.full((c, v + pad), 7.0, dtype=dtype)
    wide[:, :v] = torch.randn(c, v) * 3
    return wide, wide[:, :v]


C, KV = 6, 13


def kernel_cases():
    lab = labels(C, KV, ignored=(2,))
    teacher = torch.randn(C, KV) * 3
    probs = torch.softmax(torch.randn(C, KV), -1)
    return {
        "ce": (ce.ce_loss_and_grad, (lab,), dict(label_smoothing=0.1, softcap=4.0, lse_square_scale=0.01),
               lambda z: formulas.ce_rows(z, lab, ignore_index=IGNORE, label_smoothing=0.1, softcap=4.0,
                                          lse_square_scale=0.01)),
        "jsd": (jsd.jsd_loss_and_grad, (teacher.bfloat16(), lab), dict(beta=0.3, temperature=1.5),
                lambda z: formulas.jsd_rows(z, teacher.bfloat16(), lab, beta=0.3, temperature=1.5)),
        "kl_div": (kl_div.kl_div_loss_and_grad, (probs, lab), dict(temperature=0.8),
                   lambda z: formulas.kl_div_rows(z, probs, lab, temperature=0.8)),
    }


TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
       torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("op", ["ce", "jsd", "kl_div"])
@pytest.mark.parametrize("scale", GRAD_SCALE_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_op_writes_scaled_gradient_in_place(op, scale, dtype):
    fn, args, kwargs, rows_fn = kernel_cases()[op]
    wide, logits = logits_buffer(C, KV, dtype)
    before = logits.clone()
    inputs_before = [a.clone() for a in args]
    grad_scale = grad_scale_of(scale, C, device="cpu")
    expected_rows, expected_grad = reference(rows_fn, before, grad_scale)
    rows = fn(logits, *args, grad_scale=grad_scale, **kwargs)
    assert rows.dtype == torch.float32 and rows.shape == (C,)
    assert logits.dtype == dtype and logits.data_ptr() == wide.data_ptr()
    torch.testing.assert_close(rows.double(), expected_rows, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, expected_grad.to(dtype), **TOL[dtype])
    assert not logits[2].any() and rows[2] == 0  # the ignored row
    assert bool((wide[:, KV:] == 7.0).all())
    for a, b in zip(args, inputs_before):
        assert torch.equal(a, b)


def test_kernel_op_float64_keeps_float64():
    lab = labels(C, KV)
    logits = torch.randn(C, KV, dtype=F64)
    expected_rows, expected_grad = reference(lambda z: formulas.ce_rows(z, lab), logits, torch.tensor(0.5))
    rows = ce.ce_loss_and_grad(logits, lab, grad_scale=torch.tensor(0.5))
    assert rows.dtype == F64
    torch.testing.assert_close(rows, expected_rows)
    torch.testing.assert_close(logits, expected_grad)


def test_kernel_op_all_rows_ignored():
    logits = torch.randn(C, KV)
    rows = jsd.jsd_loss_and_grad(logits, torch.randn(C, KV), torch.full((C,), IGNORE), beta=0.5,
                                 grad_scale=torch.tensor(1.0 / C))
    assert not rows.any() and not logits.any()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_interface_closed_form_gradients(beta):
    """The closed forms the kernel backends implement agree with autograd of the formulas."""
    t, student, teacher = 1.5, torch.randn(C, KV, dtype=F64) * 2, torch.randn(C, KV, dtype=F64) * 2
    ls, lt = torch.log_softmax(student / t, -1), torch.log_softmax(teacher / t, -1)
    q, p = ls.exp(), lt.exp()
    if beta == 0.0:
        ds = q - p
    elif beta == 1.0:
        d = ls - lt
        ds = q * (d - (q * d).sum(-1, keepdim=True))
    else:
        d = ls - torch.log(beta * p + (1 - beta) * q)
        ds = (1 - beta) * q * (d - (q * d).sum(-1, keepdim=True))
    grad = student.clone()
    jsd.jsd_loss_and_grad(grad, teacher, None, beta=beta, temperature=t)
    torch.testing.assert_close(grad, ds / t)

    target = torch.softmax(torch.randn(C, KV, dtype=F64), -1) * 0.9  # sum q != 1 on purpose
    grad = student.clone()
    kl_div.kl_div_loss_and_grad(grad, target, None, temperature=t)
    torch.testing.assert_close(grad, (q * target.sum(-1, keepdim=True) - target) / t)

    y, eps, lss, cap = labels(C, KV, ignored=()), 0.1, 0.02, 3.0
    z = cap * torch.tanh(student / cap)
    lse, sm = torch.logsumexp(z, -1, keepdim=True), torch.softmax(z, -1)
    dz = sm - (1 - eps) * F.one_hot(y, KV) - eps / KV + 2 * lss * lse * sm
    grad = student.clone()
    ce.ce_loss_and_grad(grad, y, label_smoothing=eps, softcap=cap, lse_square_scale=lss)
    torch.testing.assert_close(grad, dz * (1 - torch.tanh(student / cap) ** 2))


# ---------------------------------------------------------------- mhc kernel-level ops


def mhc_kernel_inputs(hc, dtype, m=7, c=5):
    x, phi, b, *alphas = mhc_inputs(hc, c=c, lead=(m,), dtype=dtype)
    return x.reshape(m, hc * c), phi, b, *alphas


@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mhc_coeff_fwd_matches_formulas(hc, dtype):
    args = mhc_kernel_inputs(hc, dtype)
    h_pre, h_post, h_res, mix, rstd = mhc.mhc_coeff_fwd(*args, hc=hc, tmax=3, **MHC_OPTIONS)
    expected = formulas.mhc_coeffs(args[0].reshape(-1, hc, args[0].shape[1] // hc), *args[1:], tmax=3, **MHC_OPTIONS)
    x, phi = args[0].double(), args[1].double()
    expected_rstd = 1.0 / x.square().mean(-1).add(MHC_OPTIONS["rms_eps"]).sqrt()
    for got, want in zip((h_pre, h_post, h_res, mix, rstd), (*expected, (x @ phi) * expected_rstd[:, None],
                                                            expected_rstd)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("given", ["all", "pre", "post", "res", "none"])
def test_mhc_coeff_bwd_matches_autograd(hc, dtype, given):
    args = mhc_kernel_inputs(hc, dtype)
    m = args[0].shape[0]
    upstream = {"pre": torch.randn(m, hc), "post": torch.randn(m, hc), "res": torch.randn(m, hc, hc)}
    grads_in = [upstream[k] if given in ("all", k) else None for k in ("pre", "post", "res")]
    _, _, _, mix, rstd = mhc.mhc_coeff_fwd(*args, hc=hc, tmax=3, **MHC_OPTIONS)
    got = mhc.mhc_coeff_bwd(*args, mix, rstd, *grads_in, hc=hc, tmax=3, **MHC_OPTIONS)

    leaves = [a.detach().double().requires_grad_() for a in args]
    outs = formulas.mhc_coeffs(leaves[0].reshape(m, hc, -1), *leaves[1:], tmax=3, **MHC_OPTIONS)
    objective = sum((o.reshape(g.shape) * g.double()).sum() for o, g in zip(outs, grads_in) if g is not None)
    if torch.is_tensor(objective):
        expected = torch.autograd.grad(objective, leaves, allow_unused=True, materialize_grads=True)
    else:
        expected = [torch.zeros_like(a) for a in leaves]
    for g, e, a in zip(got, expected, args):
        assert g.dtype == a.dtype and g.shape == a.shape
        assert finite(g)
        tol = dict(atol=2e-2, rtol=2e-2) if g.dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g.double(), e.to(a.dtype).double(), **tol)
