"""flce's liger-kernel options against torch's own formulas, on every backend that runs here (the reference in
float64; Triton and Helion in their interpreters, fp32 against the float64 truth): class weights
(F.cross_entropy(weight=, label_smoothing=), its mean over the target weights), the z-loss returned beside the loss
(lse_square_scale lse^2, reduced as the loss, no class weight) and the token accuracy (argmax == target over the
rows not ignored), every reduction, ignored rows, random class weights. The vocab-parallel path is in
tests/test_vocab_parallel_distributed.py; liger-kernel's own tests of these options in
tests/test_flce_liger_options.py."""

import pytest
import torch
import torch.nn.functional as F

import liger_dispatch as ld
from liger_dispatch import dispatch

from kernel_checks import assert_rel_close

N, H, V = 9, 16, 37
IGNORE = -100
BACKENDS = [b for b in ("reference", "triton", "helion") if b in dispatch.available_backends("flce", "cpu")]
# Helion's interpreter compiles each specialization (seconds): its kernels run with and without smoothing, and
# with a scale for all rows and one per row (reduction="none")
HELION_CASES = {("mean", 0.1), ("none", 0.0)}
CASES = [(backend, reduction, smoothing) for backend in BACKENDS for reduction in ("mean", "sum", "none")
         for smoothing in (0.0, 0.1) if backend != "helion" or (reduction, smoothing) in HELION_CASES]


def dtype_of(backend):
    return torch.float64 if backend == "reference" else torch.float32


def make_inputs(dtype, seed=0):
    """x [N, H], w [V, H], targets with two ignored rows and two rows whose target is the argmax, class weights in
    [0.2, 2.2) (never all ones)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * H ** -0.5 * 3
    y = torch.randint(0, V, (N,), generator=g)
    y[[1, 5]] = IGNORE
    y[[0, 3]] = (x @ w.T).argmax(-1)[[0, 3]]
    weights = torch.rand(V, generator=g, dtype=torch.float64) * 2 + 0.2
    return x.to(dtype), w.to(dtype), y, weights.to(dtype)


def torch_truth(x, w, y, weights, reduction, label_smoothing, lse_square_scale):
    """(loss, z_loss, token accuracy) from torch in float64: F.cross_entropy plus the z-loss, which a mean divides
    by the rows not ignored (liger-kernel's CrossEntropyWithZLoss)."""
    logits = x.double() @ w.double().T
    ce = F.cross_entropy(logits, y, weight=None if weights is None else weights.double(), reduction=reduction,
                         label_smoothing=label_smoothing, ignore_index=IGNORE)
    valid = y != IGNORE
    z_rows = torch.where(valid, lse_square_scale * torch.logsumexp(logits, -1) ** 2, 0.0)
    correct = ((logits.argmax(-1) == y) & valid).double()
    if reduction == "none":
        return ce + z_rows, z_rows, correct
    z_loss = z_rows.sum() / valid.sum() if reduction == "mean" else z_rows.sum()
    return ce + z_loss, z_loss, correct.sum() / valid.sum()


def tolerance(backend):
    """float64 for the reference, but a mean's 1 / count and the gradients' scale are fp32 device scalars"""
    return 1e-6 if backend == "reference" else 2e-5


@pytest.mark.parametrize("backend, reduction, label_smoothing", CASES)
def test_class_weights_z_loss_and_accuracy_match_torch(backend, reduction, label_smoothing):
    x, w, y, weights = make_inputs(dtype_of(backend))
    mine = [t.clone().requires_grad_() for t in (x, w)]
    truth = [t.double().requires_grad_() for t in (x, w)]
    out = dispatch.op("flce", backend=backend)(*mine, y, None, weights, reduction=reduction,
                                               label_smoothing=label_smoothing, lse_square_scale=0.02,
                                               return_z_loss=True, return_token_accuracy=True)
    assert isinstance(out, ld.CrossEntropyOutput)
    loss, z_loss, accuracy = torch_truth(*truth, y, weights, reduction, label_smoothing, 0.02)
    tol = tolerance(backend)
    assert_rel_close("loss", out.loss, loss, tol)
    assert_rel_close("z_loss", out.z_loss, z_loss, tol)
    assert torch.equal(out.token_accuracy, accuracy.to(out.token_accuracy.dtype))
    assert not out.z_loss.requires_grad and not out.token_accuracy.requires_grad
    upstream = torch.rand(loss.shape, dtype=torch.float64) + 0.5
    (out.loss * upstream.to(out.loss.dtype)).sum().backward()
    (loss * upstream).sum().backward()
    for name, got, want in zip(("input", "weight"), mine, truth):
        assert_rel_close(f"grad of {name}", got.grad, want.grad, tol)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "helion"])
def test_class_weights_with_bias_softcap_and_chunks(backend, monkeypatch):
    """A bias and a softcap, three chunks of rows: against torch on the softcapped logits."""
    monkeypatch.setenv("LIGER_CHUNK_ROWS", "4")
    x, w, y, weights = make_inputs(dtype_of(backend), seed=1)
    bias = torch.randn(V, dtype=x.dtype)
    mine = [t.clone().requires_grad_() for t in (x, w, bias)]
    truth = [t.double().requires_grad_() for t in (x, w, bias)]
    loss = dispatch.op("flce", backend=backend)(*mine[:2], y, mine[2], weights, softcap=2.0, label_smoothing=0.2)
    logits = 2.0 * torch.tanh((truth[0] @ truth[1].T + truth[2]) / 2.0)
    want = F.cross_entropy(logits, y, weight=weights.double(), label_smoothing=0.2, ignore_index=IGNORE)
    assert_rel_close("loss", loss, want, tolerance(backend))
    loss.backward()
    want.backward()
    for name, got, expected in zip(("input", "weight", "bias"), mine, truth):
        assert_rel_close(f"grad of {name}", got.grad, expected.grad, tolerance(backend))


def test_a_tie_for_the_max_counts_as_predicted():
    """The accuracy asks whether the target's logit is the row's max: a target tied with an earlier class counts,
    where argmax's first-index rule would not."""
    x = torch.eye(4)
    w = torch.eye(4)
    w[2] = w[0]  # classes 0 and 2 have the same logit in every row: rows 0 and 2 tie them for the max
    y = torch.tensor([2, 1, 2, 3])
    out = dispatch.op("flce", backend="reference")(x, w, y, return_token_accuracy=True)
    assert out.token_accuracy.item() == 1.0
    assert ((x @ w.T).argmax(-1) == y).float().mean().item() == 0.5


def test_target_weights_summing_to_zero_give_zero_not_nan():
    """torch's weighted mean over target weights that sum to 0 is 0 / 0; here, as a mean over no row, 0."""
    x, w, y, weights = make_inputs(torch.float64)
    weights[y[y != IGNORE]] = 0.0
    xg = x.clone().requires_grad_()
    loss = dispatch.op("flce", backend="reference")(xg, w, y, None, weights, label_smoothing=0.1)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(xg.grad == 0)


def test_all_ignored_with_statistics():
    x, w, _, weights = make_inputs(torch.float64)
    out = dispatch.op("flce", backend="reference")(x, w, torch.full((N,), IGNORE), None, weights,
                                                   lse_square_scale=0.1, return_z_loss=True, return_token_accuracy=True)
    assert out == (0.0, 0.0, 0.0)


def test_the_loss_alone_unless_statistics_are_asked_for():
    x, w, y, weights = make_inputs(torch.float32)
    flce = dispatch.op("flce", backend="reference")
    assert isinstance(flce(x, w, y, None, weights), torch.Tensor)
    out = flce(x, w, y, return_z_loss=True)
    assert isinstance(out, ld.CrossEntropyOutput) and out.token_accuracy is None and out.z_loss.item() == 0.0
    rows = flce(x.view(3, 3, H), w, y.view(3, 3), reduction="none", return_token_accuracy=True)
    assert rows.loss.shape == rows.token_accuracy.shape == (3, 3) and rows.z_loss is None


def test_bad_class_weights_are_input_errors_naming_them():
    x, w, y, weights = make_inputs(torch.float32)
    flce = dispatch.op("flce", backend="reference")
    for bad, message in ((weights[:-1], "ce_weight: length is 36, expected 37"),
                         (weights.long(), "ce_weight must be bfloat16, float16 or float32"),
                         (weights.view(1, V), "ce_weight must have 1 dimension")):
        with pytest.raises(ld.InputError, match=message):
            flce(x, w, y, None, bad)
    with pytest.raises(ld.InputError, match="return_z_loss must be True or False"):
        flce(x, w, y, return_z_loss=1)


def test_module_keeps_class_weights_as_a_buffer_outside_the_state_dict():
    _, _, _, weights = make_inputs(torch.float32)
    loss = ld.nn.FusedLinearCrossEntropyLoss(ce_weight=weights, return_z_loss=True, return_token_accuracy=True)
    assert dict(loss.named_buffers())["ce_weight"] is weights and not loss.state_dict()
    assert loss.double().ce_weight.dtype == torch.float64
    x, w, y, _ = make_inputs(torch.float64)
    out = loss(x, w, y)
    want = dispatch.op("flce")(x, w, y, None, weights.double(), return_z_loss=True, return_token_accuracy=True)
    assert all(torch.equal(a, b) for a, b in zip(out, want))


def test_compiled_with_class_weights_and_statistics_has_no_graph_break():
    from torch._dynamo.utils import counters

    x, w, y, weights = make_inputs(torch.float32)
    handle = dispatch.op("flce", backend="reference")

    def step(x, w):
        out = handle(x, w, y, None, weights, label_smoothing=0.1, lse_square_scale=0.01, return_z_loss=True,
                     return_token_accuracy=True)
        return out.loss, out.z_loss, out.token_accuracy

    results = []
    counters.clear()
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):  # the trace, not inductor's code
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, z_loss, accuracy = fn(xg, wg)
        loss.backward()
        results.append((loss, z_loss, accuracy, xg.grad, wg.grad))
    assert not counters["graph_break"]
    for name, got, want in zip(("loss", "z_loss", "accuracy", "input grad", "weight grad"), *results[::-1]):
        assert_rel_close(name, got, want, 1e-6)


def test_opcheck_with_class_weights_and_statistics():
    x, w, y, weights = make_inputs(torch.float32)
    args = (x.requires_grad_(), w.requires_grad_(), y, None, weights)
    for options in (dict(reduction="mean", label_smoothing=0.1, need_grads=[True, True, False]),
                    dict(reduction="none", lse_square_scale=0.01)):
        result = torch.library.opcheck(torch.ops.liger_dispatch.flce.default, args,
                                       dict(options, return_z_loss=True, return_token_accuracy=True,
                                            backend="reference"))
        assert all(v == "SUCCESS" for v in result.values()), result
