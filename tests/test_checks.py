"""Every bad input DESIGN.md lists gets a clear error naming the argument, before any backend runs."""

import pytest
import torch

from liger_dispatch import dispatch
from liger_dispatch.errors import InputError

N, H, V = 5, 8, 13


def flce_args(**over):
    args = dict(input=torch.randn(N, H), weight=torch.randn(V, H), target=torch.randint(0, V, (N,)))
    args.update(over)
    return args


def jsd_args(**over):
    args = dict(student_input=torch.randn(N, H), student_weight=torch.randn(V, H), teacher_input=torch.randn(N, H),
                teacher_weight=torch.randn(V, H))
    args.update(over)
    return args


def kl_args(**over):
    args = dict(student_input=torch.randn(N, H), student_weight=torch.randn(V, H),
                target=torch.softmax(torch.randn(N, V), -1))
    args.update(over)
    return args


def mhc_args(hc=4, c=6, **over):
    n = hc * hc + 2 * hc
    args = dict(x=torch.randn(3, hc, c), phi=torch.randn(hc * c, n), b=torch.randn(n), alpha_pre=torch.tensor(1.0),
                alpha_post=torch.tensor(1.0), alpha_res=torch.tensor(1.0))
    args.update(over)
    return args


def call(op, args, **kwargs):
    return dispatch.op(op, backend="reference")(*args.values(), **kwargs)


BAD = [
    ("flce", flce_args(weight=torch.randn(V, H + 1)), {}, rf"^input: hidden size \(last dim\) is {H}, expected {H + 1} "
                                                         r"\(weight's dim 1\)$"),
    ("flce", flce_args(weight=torch.randn(H, V)), {}, rf"^weight has shape \({H}, {V}\) but must be \[V, H\] "
                                                     rf"\(vocabulary, hidden; input's H is {H}\).*transposed"),
    ("flce", flce_args(target=torch.randint(0, V, (N + 1,))), {}, rf"^target: shape is \[{N + 1}\], expected \[{N}\]"),
    ("flce", flce_args(target=torch.randn(N)), {}, r"target must be an integer tensor"),
    ("flce", flce_args(weight=torch.randn(V, H, dtype=torch.float16)), {}, r"weight has dtype torch.float16"),
    ("flce", flce_args(weight=torch.randn(V, H, device="meta")), {}, r"weight is on meta"),
    ("flce", flce_args(target=torch.full((N,), V)), {}, rf"target holds {V}, outside \[0, {V}\)"),
    ("flce", flce_args(target=torch.full((N,), -5)), {}, r"target holds -5"),
    ("flce", flce_args(), dict(reduction="avg"), r"reduction must be one of"),
    ("flce", flce_args(), dict(label_smoothing=1.5), r"label_smoothing must be"),
    ("flce", flce_args(), dict(softcap=0.0), r"softcap must be > 0"),
    ("flce", flce_args(bias=torch.randn(V + 1)), {}, r"bias: length"),
    ("flce", flce_args(input=torch.randint(0, 3, (N, H))), {}, r"input must be bfloat16, float16 or float32"),
    ("flce", flce_args(), dict(accum_dtype=torch.float16), r"accum_dtype"),
    ("fused_linear_jsd", jsd_args(), dict(jsd_beta=1.5), r"jsd_beta must be a number in \[0.0, 1.0\]"),
    ("fused_linear_jsd", jsd_args(), dict(jsd_beta=-0.1), r"jsd_beta"),
    ("fused_linear_jsd", jsd_args(), dict(temperature=0.0), r"temperature must be > 0"),
    ("fused_linear_jsd", jsd_args(teacher_input=torch.randn(N + 1, H)), {},
     rf"^teacher_input: number of rows is {N + 1}, expected {N} \(student_input's\)$"),
    ("fused_linear_jsd", jsd_args(teacher_weight=torch.randn(V + 2, H)), {},
     rf"^teacher_weight: vocabulary size \(dim 0\) is {V + 2}, expected {V} \(student_weight's\)$"),
    ("fused_linear_jsd", jsd_args(teacher_weight=torch.randn(H, V)), {}, r"^teacher_weight has shape .*transposed"),
    ("fused_linear_jsd", jsd_args(shift_labels=torch.zeros(N - 1, dtype=torch.long)), {},
     rf"^shift_labels: shape is \[{N - 1}\], expected \[{N}\]"),
    ("fused_linear_kl_div", kl_args(), dict(reduction="none"), r"reduction='none' is not supported"),
    ("fused_linear_kl_div", kl_args(), dict(reduction="elementwise"), r"reduction must be one of"),
    ("fused_linear_kl_div", kl_args(target=torch.rand(N, V + 1)), {}, r"target: last dim"),
    ("fused_linear_kl_div", kl_args(), dict(temperature=-1.0), r"temperature must be > 0"),
    ("mhc_coeffs", mhc_args(phi=torch.randn(4 * 5, 24)), {}, r"phi has 20 rows but x has HC\*C = 24"),
    ("mhc_coeffs", mhc_args(phi=torch.randn(24, 23)), {}, r"not HC\^2 \+ 2\*HC"),
    ("mhc_coeffs", mhc_args(x=torch.randn(3, 2, 12)), {}, r"x has 2 streams"),
    ("mhc_coeffs", mhc_args(b=torch.randn(24, dtype=torch.float64)), {}, r"b must be float32"),
    ("mhc_coeffs", mhc_args(alpha_res=torch.ones(2)), {}, r"alpha_res must be a 0-d float32"),
    ("mhc_coeffs", mhc_args(), dict(tmax=0), r"tmax must be >= 1"),
]


@pytest.mark.parametrize("op,args,kwargs,message", BAD, ids=[f"{b[0]}-{b[3][:24]}" for b in BAD])
def test_bad_input_names_the_argument(op, args, kwargs, message):
    with pytest.raises(InputError, match=message):
        call(op, args, **kwargs)


KERNEL_BAD = [
    ("ce_loss_and_grad", (torch.randn(N, V).t(), torch.zeros(V, dtype=torch.long)), {}, r"contiguous last dimension"),
    ("ce_loss_and_grad", (torch.randn(N, V), torch.zeros(N, dtype=torch.long)),
     dict(grad_scale=torch.ones(N, dtype=torch.float64)), r"grad_scale must be a float32"),
    ("jsd_loss_and_grad", (torch.randn(N, V), torch.randn(N, V + 1), None), dict(beta=0.5), r"teacher_logits has shape"),
    ("kl_div_loss_and_grad", (torch.randn(N, V), torch.rand(N, V), None), dict(eps=-1.0), r"eps must be >= 0"),
]


@pytest.mark.parametrize("op,args,kwargs,message", KERNEL_BAD, ids=[k[0] for k in KERNEL_BAD])
def test_kernel_level_bad_input(op, args, kwargs, message):
    with pytest.raises(InputError, match=message):
        dispatch.op(op, backend="reference")(*args, **kwargs)


def test_valid_inputs_pass_the_checks_and_errors_are_value_errors():
    assert issubclass(InputError, ValueError)
    dispatch.op("flce")(*flce_args(target=torch.tensor([0, 1, -100, V - 1, 2])).values())  # ignore_index is fine
