"""The vocab-parallel losses on a real process group: world size 2, gloo on the CPU, every backend whose
vocab-parallel kernels run here (Triton in its interpreter, with small blocks). Each case compares the op on this
rank's slice of the vocabulary (process_group=, or a DTensor weight) with the single-process op on the
concatenated weight: the loss (bit-for-bit equal on every rank), input.grad (the full gradient on every rank) and
weight.grad (this slice's). The slices are uneven, one case gives a rank an empty slice, the targets sit in both.
Also: FSDP2 (fully_shard) on a tiny model with liger_dispatch.nn.LMHeadLoss, and the collectives a call makes,
counted by the profiler.

The two worker processes are spawned once for the module and run every case. On a GPU host, `pytest -m gpu`
runs the same cases on two GPUs over NCCL (when the host has two) for every backend with vocab-parallel kernels,
and each op at a real shape on an NCCL group of one beside the single-process op.
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch
import torch.distributed as dist

import liger_dispatch as ld
from liger_dispatch import dispatch, nn as ldnn
from liger_dispatch.errors import InputError

from distributed_checks import group_of_one, same_on_every_rank, slice_of, spawn, verdict
from kernel_checks import FLCE_CASES, assert_rel_close

WORLD = 2
TESTED = ("reference", "triton")
# the workers run the reference and Triton only: importing Helion (~12 s) and CuTeDSL in each would dominate
BLOCKED = ("helion", "cutlass")
N, H, V = 8, 16, 37
SIZES = (13, 24)  # rank 0 holds columns [0, 13), rank 1 [13, 37)
TOL = 2e-5


def backends(device="cpu", tested=TESTED, dtype=torch.float32):
    status = dispatch.backend_status("ce_vp_stats", device, dtype)
    return [b for b, why in status.items() if why is None and (tested is None or b in tested)]


def device_type():
    return torch.get_default_device().type


@contextlib.contextmanager
def env(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def small_blocks():
    """In the interpreter, Triton's kernels stream 16-column blocks: a slice spans several, the last ragged."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return contextlib.nullcontext()
    from liger_dispatch.backends.triton import vocab_parallel as triton_vp

    return triton_vp.LAUNCH.using(block_size=16)


def randn(*shape, scale=1.0):
    return torch.randn(*shape) * scale


def labels(n=N, ignored=(1,)):
    y = torch.randint(0, V, (n,))
    y[0], y[2] = 0, V - 1  # a target in the first slice and one in the last
    y[list(ignored)] = -100
    return y


def kl_target(log_target=False, zeros=True):
    p = torch.softmax(randn(N, V, scale=2.0), dim=-1)
    if zeros:
        p[:, ::5] = 0.0
        p = p / p.sum(-1, keepdim=True)
    return p.clamp_min(1e-30).log() if log_target else p


def leaf(t, grad):
    return t.detach().clone().requires_grad_(grad)


def compare(op, backend, group, tensors, sliced, grads, sizes=SIZES, call=None, **options):
    """op on this rank's slices of the `sliced` tensors ({name: dim}) with process_group against the single-process op
    on the whole tensors; backpropagates the same upstream gradient through both and compares the `grads`."""
    rank = dist.get_rank(group)
    mine = {k: leaf(slice_of(v, sliced[k], sizes, rank) if k in sliced else v, k in grads) if v is not None else None
            for k, v in tensors.items()}
    whole = {k: leaf(v, k in grads) if v is not None else None for k, v in tensors.items()}
    run = call or (lambda **kw: dispatch.op(op, backend=backend)(**kw))
    got = run(**mine, process_group=group, **options)
    want = dispatch.op(op, backend=backend)(**whole, **options)
    if isinstance(want, ld.CrossEntropyOutput):  # the statistics beside the loss, equal on every rank too
        for name in ("z_loss", "token_accuracy"):
            assert_rel_close(f"{op} {name}", getattr(got, name), getattr(want, name), TOL)
            same_on_every_rank(f"{op} {name}", getattr(got, name), group)
        got, want = got.loss, want.loss
    upstream = torch.randn(want.shape) if want.dim() else torch.tensor(0.7)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert_rel_close(f"{op} loss", got, want, TOL)
    same_on_every_rank(f"{op} loss", got, group)
    for k in grads:
        expected = whole[k].grad
        if k in sliced:
            expected = slice_of(expected, sliced[k], sizes, rank)
        assert_rel_close(f"{op} grad of {k}", mine[k].grad, expected, TOL)


# ---------------------------------------------------------------- flce


def flce_inputs(n=N, bias=False, ignored=(1,)):
    return dict(input=randn(n, H), weight=randn(V, H, scale=H ** -0.5), target=labels(n, ignored),
                bias=randn(V) if bias else None)


def flce_case(group, backend, options):
    compare("flce", backend, group, flce_inputs(bias=options == "everything"), {"weight": 0, "bias": 0},
            ("input", "weight", "bias") if options == "everything" else ("input", "weight"), **FLCE_CASES[options])


def flce_class_weights(group, backend, reduction, sizes=SIZES):
    """ce_weight (every rank holds the whole vocabulary's), label smoothing and the z-loss, with the z-loss and the
    token accuracy returned: the single-process numbers, equal on every rank."""
    t = flce_inputs()
    t["target"][4] = (t["input"] @ t["weight"].T).argmax(-1)[4]  # a row whose target is its max
    t["ce_weight"] = torch.rand(V) * 2 + 0.2
    compare("flce", backend, group, t, {"weight": 0}, ("input", "weight"), sizes=sizes, reduction=reduction,
            label_smoothing=0.1, lse_square_scale=0.01, return_z_loss=True, return_token_accuracy=True)


def flce_3d_chunked(group, backend):
    """[2, 4, H] input, three chunks of 3, 3 and 2 rows (so three rounds of collectives), fp32 dW accumulation."""
    tensors = flce_inputs(bias=True)
    tensors["input"], tensors["target"] = tensors["input"].view(2, 4, H), tensors["target"].view(2, 4)
    with env(LIGER_CHUNK_ROWS=3):
        compare("flce", backend, group, tensors, {"weight": 0, "bias": 0}, ("input", "weight", "bias"),
                label_smoothing=0.05, accum_dtype=torch.float32)
        compare("flce", backend, group, tensors, {"weight": 0, "bias": 0}, ("input", "weight"), reduction="none")


def flce_empty_slice(group, backend):
    """Rank 0 holds no column at all."""
    compare("flce", backend, group, flce_inputs(), {"weight": 0}, ("input", "weight"), sizes=(0, V),
            label_smoothing=0.1)


def flce_all_ignored(group, backend):
    compare("flce", backend, group, flce_inputs(ignored=range(N)), {"weight": 0}, ("input", "weight"))


def flce_target_out_of_range(group, backend):
    """A class index past the whole vocabulary is an error on every rank (each rank's slice is narrower, and the
    other classes in range of the whole vocabulary but not of the slice are fine: every other case has them)."""
    t = flce_inputs()
    t["target"][3] = V
    try:
        with env(LIGER_CHECKS="full"):  # on a GPU the check is otherwise a device-side assert
            dispatch.op("flce", backend=backend)(t["input"], slice_of(t["weight"], 0, SIZES, dist.get_rank(group)),
                                                 t["target"], process_group=group)
    except InputError as e:
        assert f"outside [0, {V})" in str(e), e
    else:
        raise AssertionError("a target of V was accepted")


def flce_bf16_module(group, backend):
    """The nn module with process_group=, in bf16 (fp32 statistics; looser tolerance for the bf16 GEMMs)."""
    rank = dist.get_rank(group)
    x, w, y = randn(N, H).bfloat16(), randn(V, H, scale=H ** -0.5).bfloat16(), labels()
    mine_x, mine_w = leaf(x, True), leaf(slice_of(w, 0, SIZES, rank), True)
    loss = ldnn.FusedLinearCrossEntropyLoss(label_smoothing=0.1, backend=backend, process_group=group)
    got = loss(mine_x, mine_w, y)
    got.backward()
    whole_x, whole_w = leaf(x, True), leaf(w, True)
    want = ldnn.FusedLinearCrossEntropyLoss(label_smoothing=0.1, backend=backend)(whole_x, whole_w, y)
    want.backward()
    assert_rel_close("loss", got.float(), want.float(), 1e-2)
    assert_rel_close("input grad", mine_x.grad, whole_x.grad, 2e-2)
    assert_rel_close("weight grad", mine_w.grad, slice_of(whole_w.grad, 0, SIZES, rank), 2e-2)
    same_on_every_rank("loss", got, group)


def fp16_bounds(group, backend):
    """fp16: the gradient buffers are scaled by a bound of each row's gradient (grad_bounds.py), which on a slice
    must cover the other slices: a KL target whose mass sits on rank 1's columns, a strong z-loss, and an empty
    slice. The same numbers as the single-process op in fp16 (its own rounding: looser tolerance)."""
    rank = dist.get_rank(group)
    x, w = randn(N, H).half(), randn(V, H, scale=H ** -0.5).half()
    target = torch.softmax(randn(N, V, scale=2.0), dim=-1)
    target[:, :SIZES[0]] *= 1e-3  # rank 0's slice holds almost no mass
    target = target / target.sum(-1, keepdim=True)
    calls = [
        ("fused_linear_kl_div", dict(student_input=x, student_weight=w, target=target), {"student_weight": 0,
                                                                                          "target": 1}, SIZES, {}),
        ("flce", dict(input=x, weight=w, target=labels()), {"weight": 0}, SIZES, dict(lse_square_scale=0.5)),
        ("flce", dict(input=x, weight=w, target=labels()), {"weight": 0}, (0, V), dict(label_smoothing=0.1)),
    ]
    for op, tensors, sliced, sizes, options in calls:
        first = next(iter(tensors))
        mine = {k: leaf(slice_of(v, sliced[k], sizes, rank) if k in sliced else v, v.is_floating_point() and k != "target")
                for k, v in tensors.items()}
        whole = {k: leaf(v, v.is_floating_point() and k != "target") for k, v in tensors.items()}
        got = dispatch.op(op, backend=backend)(**mine, process_group=group, **options)
        want = dispatch.op(op, backend=backend)(**whole, **options)
        got.backward()
        want.backward()
        weight = WEIGHT_NAME[op]
        assert_rel_close(f"{op} fp16 loss", got, want, 1e-3)
        assert_rel_close(f"{op} fp16 input grad", mine[first].grad, whole[first].grad, 2e-2)
        assert_rel_close(f"{op} fp16 weight grad", mine[weight].grad,
                         slice_of(whole[weight].grad, 0, sizes, rank), 2e-2)


WEIGHT_NAME = {"flce": "weight", "fused_linear_kl_div": "student_weight"}


# ---------------------------------------------------------------- fused_linear_jsd and fused_linear_kl_div


def jsd_inputs(shift_labels=True):
    h_t = H + 4  # the teacher's hidden size may differ
    return dict(student_input=randn(N, H), student_weight=randn(V, H, scale=H ** -0.5),
                teacher_input=randn(N, h_t), teacher_weight=randn(V, h_t, scale=h_t ** -0.5),
                shift_labels=labels() if shift_labels else None)


def jsd_case(group, backend, beta, temperature, t_squared, shift_labels=True):
    compare("fused_linear_jsd", backend, group, jsd_inputs(shift_labels), {"student_weight": 0, "teacher_weight": 0},
            ("student_input", "student_weight"), jsd_beta=beta, temperature=temperature,
            scale_by_temperature_squared=t_squared)


def kl_inputs(log_target=False, zeros=True):
    return dict(student_input=randn(N, H), student_weight=randn(V, H, scale=H ** -0.5),
                target=kl_target(log_target, zeros), shift_labels=labels())


def kl_case(group, backend, reduction, log_target, zeros, temperature, eps=1e-10):
    compare("fused_linear_kl_div", backend, group, kl_inputs(log_target, zeros), {"student_weight": 0, "target": 1},
            ("student_input", "student_weight"), reduction=reduction, log_target=log_target, temperature=temperature,
            eps=eps)


def distill_modules_all_ignored(group, backend):
    """The nn modules with process_group=, every row ignored: loss 0, zero gradients."""
    jsd = ldnn.FusedLinearJSDLoss(jsd_beta=0.5, backend=backend, process_group=group)
    compare("fused_linear_jsd", backend, group, {**jsd_inputs(), "shift_labels": labels(ignored=range(N))},
            {"student_weight": 0, "teacher_weight": 0}, ("student_input", "student_weight"), jsd_beta=0.5,
            call=lambda process_group, jsd_beta, **kw: jsd(**kw))
    kl = ldnn.FusedLinearKLDivLoss(temperature=2.0, backend=backend, process_group=group)
    compare("fused_linear_kl_div", backend, group, {**kl_inputs(), "shift_labels": labels(ignored=range(N))},
            {"student_weight": 0, "target": 1}, ("student_input", "student_weight"), temperature=2.0,
            call=lambda process_group, temperature, **kw: kl(**kw))


# ---------------------------------------------------------------- fused_linear_logprobs


def logprobs_case(group, backend, sizes=SIZES, chunk_columns=None, used=(0, 1), dtype=torch.float32, tol=TOL,
                  grad_tol=TOL):
    """(logprobs, entropy) on this rank's slice of weight and bias against the single-process op: both outputs equal
    on every rank, random upstreams on both (or one), input.grad whole, weight.grad / bias.grad this slice's."""
    rank = dist.get_rank(group)
    t = flce_inputs(bias=True)
    t = {k: v.to(dtype) if v.is_floating_point() else v for k, v in t.items()}
    sliced = {"weight": 0, "bias": 0}
    mine = {k: leaf(slice_of(v, sliced[k], sizes, rank) if k in sliced else v, k != "target") for k, v in t.items()}
    whole = {k: leaf(v, k != "target") for k, v in t.items()}
    upstream = [torch.randn(N), torch.randn(N)]
    with env(**({"LIGER_CHUNK_COLUMNS": chunk_columns} if chunk_columns else {})):
        got = dispatch.op("fused_linear_logprobs", backend=backend)(**mine, process_group=group, temperature=0.7)
        want = dispatch.op("fused_linear_logprobs", backend=backend)(**whole, temperature=0.7)
        for out in (got, want):
            sum((out[i] * upstream[i]).sum() for i in used).backward()
    for i, name in enumerate(("logprobs", "entropy")):
        assert_rel_close(name, got[i], want[i], tol)
        same_on_every_rank(name, got[i], group)
    assert_rel_close("input grad", mine["input"].grad, whole["input"].grad, grad_tol)
    for k in sliced:
        assert_rel_close(f"{k} grad", mine[k].grad, slice_of(whole[k].grad, 0, sizes, rank), grad_tol)


# ---------------------------------------------------------------- DTensor weights


def dtensor_ops(group, backend):
    """Weights (and bias, teacher weight, KL target) as DTensors sharded on the vocabulary over a 1-D mesh, inputs as
    replicated DTensors: the loss is a plain tensor equal on every rank, weight.grad a DTensor shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device_type(), (WORLD,))
    rank = dist.get_rank(group)
    sizes = (19, 18)  # what Shard(0) makes of 37 columns (torch.chunk)

    def sharded(t, dim, grad=False):
        return distribute_tensor(t.detach(), mesh, [Shard(dim)]).requires_grad_(grad)

    def replicated(t, grad=False):
        return distribute_tensor(t.detach(), mesh, [Replicate()]).requires_grad_(grad)

    def check(op, tensors, placed, grads, **options):
        whole = {k: leaf(v, k in grads) if v is not None else None for k, v in tensors.items()}
        got = dispatch.op(op, backend=backend)(**placed, **options)
        want = dispatch.op(op, backend=backend)(**whole, **options)
        if isinstance(got, tuple):  # logprobs and entropy: a weighted sum of both
            got, want = (out[0].sum() + 0.5 * out[1].sum() for out in (got, want))
        got.backward()
        want.backward()
        assert not isinstance(got, DTensor)
        assert_rel_close(f"{op} loss", got, want, TOL)
        same_on_every_rank(f"{op} loss", got, group)
        for k, dim in grads.items():
            grad = placed[k].grad
            assert isinstance(grad, DTensor) and grad.placements == placed[k].placements, f"{k}.grad: {grad}"
            expected = whole[k].grad if dim is None else slice_of(whole[k].grad, dim, sizes, rank)
            assert_rel_close(f"{op} grad of {k}", grad.to_local(), expected, TOL)

    t = flce_inputs(bias=True)
    t["ce_weight"] = torch.rand(V) + 0.5  # the whole vocabulary's, a plain tensor beside the sharded weight
    check("flce", t, dict(input=replicated(t["input"], True), weight=sharded(t["weight"], 0, True),
                          target=t["target"], bias=sharded(t["bias"], 0, True), ce_weight=t["ce_weight"]),
          {"input": None, "weight": 0, "bias": 0}, label_smoothing=0.1)
    t = flce_inputs(bias=True)
    check("fused_linear_logprobs", t, dict(input=replicated(t["input"], True), weight=sharded(t["weight"], 0, True),
                                           target=t["target"], bias=sharded(t["bias"], 0, True)),
          {"input": None, "weight": 0, "bias": 0}, temperature=0.7)
    t = jsd_inputs()
    check("fused_linear_jsd", t, dict(student_input=replicated(t["student_input"], True),
                                      student_weight=sharded(t["student_weight"], 0, True),
                                      teacher_input=t["teacher_input"], teacher_weight=sharded(t["teacher_weight"], 0),
                                      shift_labels=replicated(t["shift_labels"])),
          {"student_input": None, "student_weight": 0}, jsd_beta=0.3, temperature=2.0)
    t = kl_inputs()
    check("fused_linear_kl_div", t, dict(student_input=replicated(t["student_input"], True),
                                         student_weight=sharded(t["student_weight"], 0, True),
                                         target=sharded(t["target"], 1), shift_labels=t["shift_labels"]),
          {"student_input": None, "student_weight": 0}, reduction="mean")

    try:  # a plain input beside a DTensor weight (a sharded FSDP parameter read outside forward looks the same)
        dispatch.op("flce", backend=backend)(t["student_input"], sharded(t["student_weight"], 0), labels())
    except InputError as e:
        assert "must be a DTensor" in str(e)
    else:
        raise AssertionError("a plain input beside a DTensor weight was accepted")


# ---------------------------------------------------------------- FSDP2


class TinyLM(torch.nn.Module):
    """Embedding -> Linear -> tanh -> an LM head whose forward is the fused loss (LMHeadLoss over the Linear it
    replaces): the head's weight is read by the loss, never as logits."""

    def __init__(self, loss):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, H), torch.nn.Tanh())
        self.head = ldnn.LMHeadLoss.from_linear(torch.nn.Linear(H, V, bias=False), loss)

    def forward(self, tokens, *loss_args):
        return self.head(self.body(tokens), *loss_args)


def fsdp_trains(group, backend, loss_name, outside_forward=False):
    """fully_shard on the body, the head and the root: two SGD steps on each rank's own batch give the loss and the
    (rank-averaged) gradients of the unwrapped model, and the same parameters after. outside_forward: the head is
    called on the body's output after it, as a Hugging Face causal LM's loss is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    teacher = randn(V, H + 4, scale=0.3)
    loss = {"flce": lambda: ldnn.FusedLinearCrossEntropyLoss(label_smoothing=0.1, backend=backend),
            "jsd": lambda: ldnn.FusedLinearJSDLoss(jsd_beta=0.5, temperature=2.0, backend=backend),
            "kl": lambda: ldnn.FusedLinearKLDivLoss(backend=backend)}[loss_name]
    plain = TinyLM(loss())
    sharded = TinyLM(loss())
    sharded.load_state_dict(plain.state_dict())
    mesh = init_device_mesh(device_type(), (WORLD,))
    for block in (sharded.body, sharded.head, sharded):
        fully_shard(block, mesh=mesh)
    assert list(sharded.state_dict()) == list(plain.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, sharded)]
    rank = dist.get_rank(group)
    generator = torch.Generator(torch.get_default_device()).manual_seed(rank)  # each rank its own batch
    for step in range(2):
        tokens = torch.randint(0, V, (N,), generator=generator)
        hidden_t = torch.randn(N, H + 4, generator=generator)
        args = {"flce": (labels(),), "jsd": (hidden_t, teacher, labels()), "kl": (kl_target(),)}[loss_name]
        losses = []
        for model, opt in zip((plain, sharded), optimizers):
            opt.zero_grad()
            value = model.head(model.body(tokens), *args) if outside_forward else model(tokens, *args)
            value.backward()
            losses.append(value)
        assert_rel_close(f"step {step} loss", losses[1], losses[0], TOL)
        for name, p in plain.named_parameters():
            dist.all_reduce(p.grad, group=group)  # FSDP averages the gradients of the ranks' batches
            p.grad /= WORLD
            theirs = dict(sharded.named_parameters())[name]
            assert_rel_close(f"step {step} grad of {name}", theirs.grad.full_tensor(), p.grad, TOL)
        for opt in optimizers:
            opt.step()
    for name, p in plain.named_parameters():
        assert_rel_close(f"{name} after two steps", dict(sharded.named_parameters())[name].full_tensor(), p, TOL)


# ---------------------------------------------------------------- collectives per call


def collectives(fn) -> int:
    """How many c10d collectives fn() runs, as the profiler records them (the real process group's calls)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("c10d::"))


def collective_count(group, backend):
    """Per call: 1 all-gather of the slice sizes (process_group=; none for a DTensor), per chunk 1 all-gather of the
    row statistics (JSD: and 1 all-reduce of its sums), 1 all-reduce of dX. Forward and backward together."""
    rank = dist.get_rank(group)
    t = flce_inputs()
    w = leaf(slice_of(t["weight"], 0, SIZES, rank), True)
    j = jsd_inputs()
    js, jt = (leaf(slice_of(j[k], 0, SIZES, rank), k == "student_weight") for k in ("student_weight", "teacher_weight"))
    k = kl_inputs()
    ks, kt = leaf(slice_of(k["student_weight"], 0, SIZES, rank), True), slice_of(k["target"], 1, SIZES, rank)
    x = leaf(t["input"], True)
    calls = {
        "flce": (lambda: dispatch.op("flce", backend=backend)(x, w, t["target"], process_group=group), 1),
        "jsd": (lambda: dispatch.op("fused_linear_jsd", backend=backend)(
            x, js, j["teacher_input"], jt, process_group=group), 2),
        "kl": (lambda: dispatch.op("fused_linear_kl_div", backend=backend)(x, ks, kt, process_group=group), 1),
    }
    for chunks, rows in ((1, N), (3, 3)):
        with env(LIGER_CHUNK_ROWS=rows):
            for name, (loss, per_chunk) in calls.items():
                count = collectives(lambda: loss().backward())
                assert count == 1 + per_chunk * chunks + 1, f"{name}, {chunks} chunk(s): {count} collectives"


# ---------------------------------------------------------------- the cases, run by one pair of workers


def cases(device="cpu", tested=TESTED):
    cases = {}
    for backend in backends(device, tested):
        def add(name, fn, **kw):
            cases[f"{name}[{backend}]"] = functools.partial(_setup_and_run, fn, backend=backend, **kw)

        for options in FLCE_CASES:
            add(f"flce-{options}", flce_case, options=options)
        for reduction in ("mean", "none"):
            add(f"flce-class-weights-{reduction}", flce_class_weights, reduction=reduction)
        add("flce-class-weights-empty-slice", flce_class_weights, reduction="sum", sizes=(0, V))
        add("flce-3d-chunked", flce_3d_chunked)
        add("flce-empty-slice", flce_empty_slice)
        add("flce-all-ignored", flce_all_ignored)
        add("flce-target-out-of-range", flce_target_out_of_range)
        add("flce-bf16-module", flce_bf16_module)
        add("fp16-gradient-bounds", fp16_bounds)
        for beta in (0.0, 0.5, 1.0):
            for temperature, t_squared in ((1.0, False), (2.0, True)):
                add(f"jsd-beta{beta}-T{temperature}", jsd_case, beta=beta, temperature=temperature,
                    t_squared=t_squared)
        add("jsd-no-labels", jsd_case, beta=0.3, temperature=0.7, t_squared=False, shift_labels=False)
        for reduction in ("batchmean", "mean", "sum"):
            add(f"kl-{reduction}", kl_case, reduction=reduction, log_target=False, zeros=True, temperature=1.0)
        add("kl-log-target", kl_case, reduction="batchmean", log_target=True, zeros=False, temperature=2.0)
        add("kl-eps", kl_case, reduction="sum", log_target=False, zeros=True, temperature=0.5, eps=1e-3)
        add("distill-modules-all-ignored", distill_modules_all_ignored)
        add("logprobs", logprobs_case)
        add("logprobs-chunked-no-entropy-grad", logprobs_case, chunk_columns=3, used=(0,))
        add("logprobs-empty-slice-entropy-grad", logprobs_case, sizes=(0, V), used=(1,))
        add("logprobs-fp16", logprobs_case, chunk_columns=3, dtype=torch.float16, tol=1e-3, grad_tol=2e-2)
        add("dtensor", dtensor_ops)
        for loss_name in ("flce", "jsd", "kl"):
            add(f"fsdp2-{loss_name}", fsdp_trains, loss_name=loss_name)
        add("fsdp2-flce-head-outside-forward", fsdp_trains, loss_name="flce", outside_forward=True)
        add("collective-count", collective_count)
    return cases


def _setup_and_run(fn, group, backend, **kw):
    with small_blocks():
        fn(group, backend, **kw)


CASES = cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(CASES, WORLD, str(tmp_path_factory.mktemp("gloo")), blocked=BLOCKED)


@pytest.mark.parametrize("name", list(CASES))
def test_case(results, name):
    verdict(results, name)


def test_compiled_with_a_process_group():
    """torch.compile(fullgraph=True) over a call with process_group (a ProcessGroup; the torch op takes its name):
    the eager loss and gradients, on a gloo group of one in this process."""
    torch.manual_seed(0)
    tensors = flce_inputs(bias=True)
    handle = dispatch.op("flce", backend="reference")
    with group_of_one("gloo") as group:
        results = []
        for fn in (handle, torch.compile(handle, fullgraph=True)):
            x, w, b = (leaf(tensors[k], True) for k in ("input", "weight", "bias"))
            loss = fn(x, w, tensors["target"], b, label_smoothing=0.1, process_group=group)
            loss.backward()
            results.append((loss, x.grad, w.grad, b.grad))
    for name, got, want in zip(("loss", "input grad", "weight grad", "bias grad"), *results[::-1]):
        assert_rel_close(name, got, want, 1e-6)


def test_compiled_logprobs_with_a_process_group():
    """The same for fused_linear_logprobs: its backward op takes the group's name too."""
    torch.manual_seed(0)
    tensors = flce_inputs(bias=True)
    handle = dispatch.op("fused_linear_logprobs", backend="reference")
    upstream = torch.randn(2, N)
    with group_of_one("gloo") as group:
        results = []
        for fn in (handle, torch.compile(handle, fullgraph=True)):
            x, w, b = (leaf(tensors[k], True) for k in ("input", "weight", "bias"))
            lp, ent = fn(x, w, tensors["target"], b, temperature=0.7, process_group=group)
            ((lp * upstream[0]).sum() + (ent * upstream[1]).sum()).backward()
            results.append((lp, ent, x.grad, w.grad, b.grad))
    for name, got, want in zip(("logprobs", "entropy", "input grad", "weight grad", "bias grad"), *results[::-1]):
        assert_rel_close(name, got, want, 1e-6)


# ---------------------------------------------------------------- on the GPU host


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")
def test_nccl_two_gpus(tmp_path):
    """Every case above on two GPUs over NCCL, for every backend with vocab-parallel kernels there."""
    on_gpus = cases("cuda", tested=None)
    results = spawn(on_gpus, WORLD, str(tmp_path), backend="nccl")
    failures = []
    for name in on_gpus:
        try:
            verdict(results, name)
        except AssertionError as e:
            failures.append(f"== {name}\n{e}")
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def nccl_group_of_one():
    with group_of_one("nccl") as group:
        yield group


REAL = dict(N=2048, H=4096, V=128256)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["flce", "fused_linear_jsd", "fused_linear_kl_div"])
@pytest.mark.parametrize("backend", backends("cuda", None, torch.bfloat16) if torch.cuda.is_available() else [])
def test_nccl_group_of_one_real_shape(nccl_group_of_one, op, backend):
    """The llama3 head (N=2048, bf16) on a group of one: the vocab-parallel path gives the single-process numbers
    (its own kernels, so to the rounding of bf16 gradients)."""
    from benchmarks import workloads
    from benchmarks.shapes import Case

    case = Case(op, "llama3", REAL["N"], tuple(REAL.items()), torch.bfloat16, "fwd+bwd")
    inputs = workloads.make_inputs(case, torch.device("cuda"), seed=0)
    mine = [leaf(a, a.requires_grad) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in inputs.args]
    handle = dispatch.op(op, backend=backend)
    want = handle(*inputs.args, **inputs.kwargs)
    got = handle(*mine, process_group=nccl_group_of_one, **inputs.kwargs)
    want.backward()
    got.backward()
    assert_rel_close("loss", got, want, 1e-4)
    assert_rel_close("input grad", mine[0].grad, inputs.args[0].grad, 1e-2)
    assert_rel_close("weight grad", mine[1].grad, inputs.args[1].grad, 1e-2)
