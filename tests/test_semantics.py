"""What each op does where PyTorch would differ or crash, pinned down: the labels' shape, options that are not
finite numbers (or not bools), raw errors that are InputErrors naming the argument, empty and all-ignored
batches, the loss dtype. README.md ("What the losses return") says the same in prose."""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_dispatch import dispatch
from liger_dispatch.core.table import TABLE
from liger_dispatch.errors import InputError

N, H, V = 8, 8, 13
HC, C = 4, 6
M = HC * HC + 2 * HC


def _labels(*shape):
    return torch.randint(0, V, shape)


def _mhc_params():
    return torch.randn(HC * C, M), torch.randn(M), torch.tensor(1.0), torch.tensor(1.0), torch.tensor(1.0)


# Valid positional arguments of every op with keyword options (kernel-level: one chunk of N rows).
ARGS = {
    "flce": lambda: (torch.randn(N, H), torch.randn(V, H), _labels(N)),
    "fused_linear_jsd": lambda: (torch.randn(N, H), torch.randn(V, H), torch.randn(N, H), torch.randn(V, H)),
    "fused_linear_kl_div": lambda: (torch.randn(N, H), torch.randn(V, H), torch.softmax(torch.randn(N, V), -1)),
    "fused_linear_logprobs": lambda: (torch.randn(N, H), torch.randn(V, H), _labels(N)),
    "mhc_coeffs": lambda: (torch.randn(3, HC, C), *_mhc_params()),
    "mhc_coeff_fwd": lambda: (torch.randn(3, HC * C), *_mhc_params()),
    "ce_loss_and_grad": lambda: (torch.randn(N, V), _labels(N)),
    "ce_vp_stats": lambda: (torch.randn(N, V), _labels(N)),
    "ce_vp_grad": lambda: (torch.randn(N, V), _labels(N), torch.zeros(N, 5)),
    "jsd_loss_and_grad": lambda: (torch.randn(N, V), torch.randn(N, V)),
    "jsd_vp_stats": lambda: (torch.randn(N, V), torch.randn(N, V)),
    "jsd_vp_sums": lambda: (torch.randn(N, V), torch.randn(N, V), torch.zeros(N, 2)),
    "jsd_vp_grad": lambda: (torch.randn(N, V), torch.randn(N, V), torch.zeros(N, 2), torch.zeros(N, 2)),
    "kl_div_loss_and_grad": lambda: (torch.randn(N, V), torch.softmax(torch.randn(N, V), -1)),
    "kl_div_vp_stats": lambda: (torch.randn(N, V), torch.softmax(torch.randn(N, V), -1)),
    "kl_div_vp_grad": lambda: (torch.randn(N, V), torch.softmax(torch.randn(N, V), -1), torch.zeros(N), torch.ones(N)),
    "logprobs_stats": lambda: (torch.randn(N, V), _labels(N)),
    "logprobs_grad": lambda: (torch.randn(N, V), _labels(N), torch.zeros(N, 3), torch.ones(N)),
    "check_class_indices": lambda: (_labels(N),),
    "valid_rows": lambda: (_labels(N),),
}
REQUIRED = {"mhc_coeff_fwd": dict(hc=HC), "check_class_indices": dict(vocab=V, ignore_index=-100),
            "valid_rows": dict(ignore_index=-100)}
UNCHECKED = {("mhc_coeff_fwd", "hc")}  # hc is checked against phi's columns (an error naming phi)
NOT_NUMBERS = {"float": (True, math.inf, -math.inf, math.nan, "1.0"), "Optional[float]": (True, math.inf, math.nan),
               "int": (True, 1.5, "1"), "bool": (1, None, "yes")}


def call(op, *args, backend="reference", **kwargs):
    return dispatch.op(op, backend=backend)(*args, **kwargs)


def test_every_op_with_options_has_valid_arguments_here():
    with_options = {name for name in TABLE.op_names()
                    if any(p.keyword_only and p.type in NOT_NUMBERS for p in TABLE.spec(name).schema.params)}
    assert with_options - {"mhc_coeff_bwd"} <= set(ARGS)  # mhc_coeff_bwd shares mhc_coeff_fwd's option checks
    for op, make in ARGS.items():
        call(op, *make(), **REQUIRED.get(op, {}))


CASES = [(op, p.name, value) for op in ARGS for p in TABLE.spec(op).schema.params
         if p.keyword_only and (op, p.name) not in UNCHECKED for value in NOT_NUMBERS.get(p.type, ())]


@pytest.mark.parametrize("op,option,value", CASES, ids=[f"{o}-{n}={v!r}" for o, n, v in CASES])
def test_an_option_that_is_not_a_finite_number_or_a_bool_is_an_input_error_naming_it(op, option, value):
    """label_smoothing=True, softcap=inf, temperature=nan, log_target=None, ...: on every op, user- and kernel-level."""
    with pytest.raises(InputError, match=rf"^{option} must "):
        call(op, *ARGS[op](), **{**REQUIRED.get(op, {}), option: value})


# ---------------------------------------------------------------- the labels' shape


def test_labels_are_one_per_row_of_the_input_not_only_the_same_count():
    x, w = torch.randn(N, H), torch.randn(V, H)
    with pytest.raises(ValueError, match="Expected input batch_size"):  # what torch says
        F.cross_entropy(x @ w.t(), _labels(2, 4))
    with pytest.raises(InputError, match=r"^target: shape is \[2, 4\], expected \[8\] \(input has shape \[8, 8\]"):
        call("flce", x, w, _labels(2, 4))
    with pytest.raises(InputError, match=r"^shift_labels: shape is \[2, 4\], expected \[8\]"):
        call("fused_linear_jsd", x, w, torch.randn(N, H), w, _labels(2, 4))
    with pytest.raises(InputError, match=r"^shift_labels: shape is \[2, 4\], expected \[8\]"):
        call("fused_linear_kl_div", x, w, torch.softmax(torch.randn(N, V), -1), _labels(2, 4))
    with pytest.raises(InputError, match=r"^target: leading shape \(all but the last dim\) is \[2, 4\], expected \[8\]"):
        call("fused_linear_kl_div", x, w, torch.softmax(torch.randn(2, 4, V), -1))
    with pytest.raises(InputError, match=r"^target: shape is \[2, 4\], expected \[8\]"):
        call("fused_linear_logprobs", x, w, _labels(2, 4))
    with pytest.raises(InputError, match=r"^labels must have 1 dimension"):  # a kernel-level chunk: [C]
        call("jsd_loss_and_grad", torch.randn(N, V), torch.randn(N, V), _labels(2, 4))


def test_a_batched_input_takes_labels_of_its_leading_shape_or_flattened():
    """[B, T, H] with [B, T] or [B*T] labels: the rows F.cross_entropy(logits.view(-1, V), labels.view(-1)) sees.
    [T, B] labels of the same count are an error (they pair rows by accident)."""
    x, w, y = torch.randn(2, 4, H), torch.randn(V, H), _labels(2, 4)
    want = F.cross_entropy((x @ w.t()).view(-1, V), y.view(-1), reduction="none")
    torch.testing.assert_close(call("flce", x, w, y, reduction="none"), want.view(2, 4))
    torch.testing.assert_close(call("flce", x, w, y.view(-1), reduction="none"), want)
    with pytest.raises(InputError, match=r"^target: shape is \[4, 2\], expected \[2, 4\] or \[8\]"):
        call("flce", x, w, y.view(4, 2))
    teacher = torch.softmax(torch.randn(8, V), -1)
    a = call("fused_linear_kl_div", x, w, teacher.view(2, 4, V), y)
    b = call("fused_linear_kl_div", x, w, teacher, y.view(-1))
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- raw errors that are InputErrors now


def _sparse_input():
    return torch.randn(N, H).to_sparse()


RAW = [
    ("flce", lambda: (torch.randn(N, H), torch.randn(V, H), _labels(N), torch.randn(V, dtype=torch.float64)), {},
     r"^bias has dtype torch.float64 but input has torch.float32"),
    ("flce", lambda: (torch.randn(N, H), torch.randn(V, H), _labels(N), torch.randn(V, dtype=torch.bfloat16)), {},
     r"^bias has dtype torch.bfloat16"),
    ("fused_linear_logprobs", lambda: (torch.randn(N, H), torch.randn(V, H), _labels(N), torch.randn(V).half()), {},
     r"^bias has dtype torch.float16 but input has torch.float32"),
    ("flce", lambda: (torch.randn(N, 0), torch.randn(V, 0), _labels(N)), {},
     r"^input has shape \(8, 0\): its hidden size \(last dim\) is 0"),
    ("fused_linear_jsd", lambda: (torch.randn(N, 0), torch.randn(V, 0), torch.randn(N, 0), torch.randn(V, 0)), {},
     r"^student_input has shape \(8, 0\): its hidden size"),
    ("fused_linear_kl_div", lambda: (torch.randn(N, 0), torch.randn(V, 0), torch.rand(N, V)), {},
     r"^student_input has shape \(8, 0\)"),
    ("flce", lambda: (_sparse_input(), torch.randn(V, H), _labels(N)), {},
     r"^input is a torch.sparse_coo tensor; .* pass input.to_dense\(\)"),
    ("flce", lambda: (torch.randn(N, H), torch.randn(V, H).to_sparse(), _labels(N)), {},
     r"^weight is a torch.sparse_coo tensor"),
    ("flce", lambda: (torch.randn(N, H), torch.randn(V, H), _labels(N).to_sparse()), {}, r"^target is a torch.sparse"),
    ("fused_linear_jsd", lambda: (torch.randn(N, H), torch.randn(V, H), _sparse_input(), torch.randn(V, H)), {},
     r"^teacher_input is a torch.sparse_coo"),
    ("fused_linear_kl_div", lambda: (torch.randn(N, H), torch.randn(V, H), torch.rand(N, V).to_sparse()), {},
     r"^target is a torch.sparse_coo"),
    ("mhc_coeffs", lambda: (torch.randn(3, HC, C).to_sparse(), *_mhc_params()), {}, r"^x is a torch.sparse_coo"),
    ("mhc_coeffs", lambda: (torch.randn(3, HC, 0), torch.randn(0, M), *_mhc_params()[1:]), {},
     r"^x has shape \(3, 4, 0\): its channel count C \(last dim\) is 0"),
    ("ce_loss_and_grad", lambda: (torch.randn(N, V), _labels(N)), dict(grad_scale=0.5),
     r"^grad_scale must be a float32 tensor of shape \[\] or \[8\], got float 0.5"),
    ("jsd_loss_and_grad", lambda: (torch.randn(N, V), torch.randn(N, V)), dict(grad_scale=1), r"^grad_scale must be"),
    ("kl_div_loss_and_grad", lambda: (torch.randn(N, V), torch.rand(N, V)), dict(grad_scale=2.0), r"^grad_scale must"),
    ("ce_loss_and_grad", lambda: (torch.randn(N, V).to_sparse(), _labels(N)), {}, r"^logits is a torch.sparse_coo"),
]


@pytest.mark.parametrize("op,make,kwargs,message", RAW, ids=[f"{r[0]}-{r[3][1:30]}" for r in RAW])
def test_what_crashed_inside_the_op_is_an_input_error_naming_the_argument(op, make, kwargs, message):
    with pytest.raises(InputError, match=message):
        call(op, *make(), **kwargs)


# ---------------------------------------------------------------- empty batches and the loss dtype

LOSSES = {
    "flce": lambda n, y: (torch.randn(n, H), torch.randn(V, H), y),
    "fused_linear_jsd": lambda n, y: (torch.randn(n, H), torch.randn(V, H), torch.randn(n, H), torch.randn(V, H), y),
    "fused_linear_kl_div": lambda n, y: (torch.randn(n, H), torch.randn(V, H), torch.softmax(torch.randn(n, V), -1), y),
}
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not dispatch.available_backends("flce", device="cpu", dtype=torch.float32).count("triton"),
    reason="triton does not run on the CPU here (TRITON_INTERPRET unset or triton missing)"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(LOSSES))
@pytest.mark.parametrize("n,labels", [(0, torch.zeros(0, dtype=torch.long)), (4, torch.full((4,), -100))],
                         ids=["no rows", "all ignored"])
def test_an_empty_or_all_ignored_batch_is_a_zero_loss_with_zero_gradients(backend, op, n, labels):
    """F.cross_entropy gives NaN there (0 / 0); a batch of padding gives 0 here, and no gradient, so a training
    loop's loss and weights stay finite."""
    args = [t.requires_grad_() if i < 2 else t for i, t in enumerate(LOSSES[op](n, labels))]
    loss = call(op, *args, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and args[0].grad.abs().sum() == 0 and args[1].grad.abs().sum() == 0
    if op == "flce":
        assert F.cross_entropy(args[0] @ args[1].t(), labels).isnan()  # torch's, for contrast


@pytest.mark.parametrize("op", list(LOSSES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_call_returns_an_fp32_loss(op, dtype):
    """Where F.cross_entropy on bf16 logits returns bf16, the loss here is fp32: it is computed in fp32 from the
    logits on, and rounding a sum over the batch to 8 bits of mantissa would throw that away."""
    args = [t.to(dtype) if t.is_floating_point() else t for t in LOSSES[op](N, _labels(N))]
    assert call(op, *args).dtype == torch.float32
    if op == "flce":
        assert call(op, *args, reduction="none").dtype == torch.float32
        assert F.cross_entropy(args[0] @ args[1].t(), args[2]).dtype == dtype  # torch's, for contrast
