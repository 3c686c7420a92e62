"""The Helion kernels beyond what the registry-driven conformance suite covers: config lookup and fallback,
forced configs with several blocks a row (a ragged last one), several row tiles, row strides wider than V,
every grad_scale form, inputs never written; the mHC kernels over several K blocks and row tiles.

On the CPU they run under TRITON_INTERPRET=1 (Helion's generated Triton in Triton's interpreter) on tiny shapes;
each new input specialization costs a Helion compile of seconds, so the tests share a few. `pytest -m gpu` adds
the real vocabularies, an mHC layer of real size and a row offset past 2^31.
"""

import json
import os

import helion
import pytest
import torch

from liger_dispatch.backends.helion import _support, ce, jsd, kl_div, mhc
from liger_dispatch.backends.reference import mhc as reference_mhc
from liger_dispatch.backends.reference.formulas import ce_rows, jsd_rows, kl_div_rows

from kernel_checks import DEVICE, GRAD_SCALE_FORMS, IGNORE, check, check_rows_relative, inputs, reference
from kernel_checks import grad_scale as grad_scale_of

C, V = 5, 37
logits, labels = inputs(C, V)
ONE_ROW_BLOCKS_OF_16 = {"block_sizes": [1, 16], "num_warps": 1, "num_stages": 1}  # 3 blocks a row, the last of 5


# ---------------------------------------------------------------- configs


def test_config_keys_and_buckets():
    assert [_support.bucket(n) for n in (1, 16, 37, 32000, 128256, 262208)] == [1, 16, 64, 32768, 131072, 524288]
    assert _support.config_key("sm90", torch.bfloat16, 131072) == "sm90/bf16/131072"
    assert _support.config_key("sm90", torch.float32, (4, 16384)) == "sm90/fp32/4x16384"
    assert _support.device_family(torch.device("cpu")) == "cpu"


def test_config_lookup_falls_back_to_the_default(tmp_path, monkeypatch):
    tuned = {"block_sizes": [1, 2048], "num_warps": 4, "num_stages": 2}
    table = {"kernel": "ce_loss_and_grad", "configs": {"cpu/bf16/131072": {"config": tuned, "source": "tuned"}}}
    (tmp_path / "ce_loss_and_grad.json").write_text(json.dumps(table))
    monkeypatch.setattr(_support, "CONFIG_DIR", tmp_path)
    _support.reload_configs()
    try:
        cpu = torch.device("cpu")
        assert ce.KERNEL.config(cpu, torch.bfloat16, 131072) == (tuned, "tuned")
        config, source = ce.KERNEL.config(cpu, torch.float16, 131072)  # a dtype the table lacks
        assert (config, source) == (ce.default_config(131072), "default (not in the table)")
        assert ce.KERNEL.config(cpu, torch.bfloat16, 64)[0] == ce.default_config(64)  # a bucket it lacks
        assert mhc.MIX.config(cpu, torch.bfloat16, (4, 128))[1].startswith("default")  # no table at all
    finally:
        monkeypatch.undo()
        _support.reload_configs()


def test_committed_tables_match_their_kernels():
    """Every committed entry has the shape of its kernel's default config (same number of block sizes)."""
    kernels = {k.name: k for k in (ce.KERNEL, jsd.MIXTURE, kl_div.KERNEL, mhc.MIX, mhc.COEFFS, mhc.COEFF_GRADS,
                                   mhc.SUM_PARTIALS, mhc.MM_RMS_BACKWARD)}
    paths = sorted(_support.CONFIG_DIR.glob("*.json"))
    assert paths
    for path in paths:
        table = json.loads(path.read_text())
        kernel = kernels[table["kernel"]]
        assert path.stem == kernel.name
        for key, entry in table["configs"].items():
            family, dtype, shape = key.split("/")
            shape_key = tuple(map(int, shape.split("x"))) if "x" in shape else int(shape)
            default = kernel.default_config(shape_key)
            assert len(entry["config"]["block_sizes"]) == len(default["block_sizes"]), (path.name, key)
            assert entry["source"] in ("tuned", "default")


def test_int64_offsets_follow_strides_not_numel():
    wide_rows = torch.empty(2, 2**31, device="meta")[:, :4]  # 8 elements, the second row 2^31 further
    assert _support.needs_int64(wide_rows)
    assert not _support.needs_int64(torch.empty(4, 1000, device="meta"))


# ---------------------------------------------------------------- loss kernels


@pytest.mark.parametrize("scale", GRAD_SCALE_FORMS)
def test_ce_blocks_row_stride_and_grad_scales(scale):
    x = logits(row_stride=V + 11)
    target = labels()
    grad_scale = grad_scale_of(scale, C)
    expected = reference(lambda z: ce_rows(z, target, ignore_index=IGNORE), x, grad_scale)
    with ce.KERNEL.using(ONE_ROW_BLOCKS_OF_16):
        loss = ce.ce_loss_and_grad(x, target, grad_scale=grad_scale, ignore_index=IGNORE)
    check(loss, x, *expected)
    assert (x._base[:, V:] == 7.0).all()  # the padding past V is never written


@pytest.mark.parametrize("rows_per_program", [1, 2])
def test_ce_every_option_over_several_blocks(rows_per_program):
    options = dict(label_smoothing=0.1, softcap=5.0, lse_square_scale=1e-2)
    x = logits(scale=8.0)
    target = labels(ignored=(0, 3))
    expected = reference(lambda z: ce_rows(z, target, ignore_index=IGNORE, **options), x)
    config = {**ONE_ROW_BLOCKS_OF_16, "block_sizes": [rows_per_program, 16]}  # 2 rows: a ragged last row tile
    with ce.KERNEL.using(config):
        loss = ce.ce_loss_and_grad(x, target, ignore_index=IGNORE, **options)
    check(loss, x, *expected)
    assert (x[[0, 3]] == 0).all() and (loss[[0, 3]] == 0).all()


@pytest.mark.parametrize("beta, labelled", [(0.0, False), (1.0, True), (0.4, True)])
def test_jsd_over_several_blocks(beta, labelled):
    student = logits(row_stride=V + 3)
    teacher = logits(scale=3.0)
    teacher_before = teacher.clone()
    lab = labels() if labelled else None
    grad_scale = torch.rand(C, device=DEVICE)
    options = dict(beta=beta, temperature=1.7)
    expected = reference(lambda s: jsd_rows(s, teacher, lab, ignore_index=IGNORE, **options), student, grad_scale)
    kernel = jsd.KL_PAIR if beta in (0.0, 1.0) else jsd.MIXTURE
    with kernel.using(ONE_ROW_BLOCKS_OF_16):
        loss = jsd.jsd_loss_and_grad(student, teacher, lab, grad_scale=grad_scale, ignore_index=IGNORE, **options)
    check(loss, student, *expected)
    assert torch.equal(teacher, teacher_before)


@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_over_several_blocks(log_target):
    student = logits()
    probs = torch.softmax(torch.randn(C, V, device=DEVICE) * 2, dim=-1)
    probs[0, :9] = 0.0  # 0 log 0 = 0, also as a log-target of -inf
    target = probs.log() if log_target else probs
    target_before = target.clone()
    lab = None if log_target else labels()
    options = dict(temperature=0.8, log_target=log_target)
    expected = reference(lambda s: kl_div_rows(s, target, lab, ignore_index=IGNORE, **options), student)
    with kl_div.KERNEL.using(ONE_ROW_BLOCKS_OF_16):
        loss = kl_div.kl_div_loss_and_grad(student, target, lab, ignore_index=IGNORE, **options)
    check(loss, student, *expected)
    assert torch.equal(target, target_before)


def test_bf16_logits_round_once():
    x = logits(dtype=torch.bfloat16)
    target = labels()
    expected = reference(lambda z: ce_rows(z, target, ignore_index=IGNORE), x)
    with ce.KERNEL.using(ONE_ROW_BLOCKS_OF_16):
        loss = ce.ce_loss_and_grad(x, target, ignore_index=IGNORE)
    check(loss, x, *expected)


# ---------------------------------------------------------------- mHC


@pytest.mark.skipif(os.environ.get("HELION_INTERPRET") == "1", reason="Helion's eager interpreter has no CPU hl.dot")
def test_mhc_over_several_k_blocks_and_row_tiles():
    """M = 37 rows in tiles of 16, K = 96 in blocks of 32; no grad for h_pre."""
    hc, channels, rows, tmax = 4, 24, 37, 3
    k, n = hc * channels, hc * hc + 2 * hc
    x = torch.randn(rows, k, device=DEVICE)
    params = (x, torch.randn(k, n, device=DEVICE) / k**0.5, torch.randn(n, device=DEVICE),
              *(torch.tensor(v, device=DEVICE) for v in (0.8, 1.1, 0.6)))
    grads = (None, torch.randn(rows, hc, device=DEVICE), torch.randn(rows, hc, hc, device=DEVICE))
    rows_of_16 = {"block_sizes": [16], "num_warps": 1, "num_stages": 1}
    with mhc.MIX.using({"block_sizes": [16, 32], "num_warps": 1, "num_stages": 1}), \
            mhc.COEFFS.using(rows_of_16), mhc.COEFF_GRADS.using(rows_of_16), \
            mhc.SUM_PARTIALS.using({"block_sizes": [8, 16], "num_warps": 1, "num_stages": 1}), \
            mhc.MM_RMS_BACKWARD.using({"block_sizes": [32, 16], "num_warps": 1, "num_stages": 1}):
        got_fwd = mhc.mhc_coeff_fwd(*params, hc=hc, tmax=tmax)
        got_bwd = mhc.mhc_coeff_bwd(*params, *got_fwd[3:], *grads, hc=hc, tmax=tmax)
    want_fwd = reference_mhc.mhc_coeff_fwd(*params, hc=hc, tmax=tmax)
    want_bwd = reference_mhc.mhc_coeff_bwd(*params, *want_fwd[3:], *grads, hc=hc, tmax=tmax)
    for got, want in zip(got_fwd + got_bwd, want_fwd + want_bwd):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(os.environ.get("HELION_INTERPRET") == "1", reason="no generated code in Helion's eager mode")
def test_sinkhorn_iterates_are_fenced():
    """The producer writes each Sinkhorn iterate in one loop and reads them back, last first, in the next: Helion
    must put a CTA barrier between the two (the interpreter runs each program as one thread and cannot tell)."""
    rows, hc = 4, 4
    n = hc * hc + 2 * hc

    def f32(*shape):
        return torch.randn(*shape, device=DEVICE)

    def split(t):
        return t[..., :hc], t[..., hc:2 * hc], t[..., 2 * hc:].unflatten(-1, (hc, hc))

    part = f32(rows, n + 3)
    args = (*split(f32(rows, n)), *split(f32(n)), *(torch.tensor(v, device=DEVICE) for v in (0.8, 1.1, 0.6)),
            f32(rows), None, f32(rows, hc), f32(rows, hc, hc), *split(f32(rows, n)), f32(rows),
            *split(part[:, :n]), part[:, n:], f32(rows, 2, hc, hc), 3, 1e-6, 2.0, 0.1)
    config = helion.Config(**mhc.COEFF_GRADS.default_config(hc))
    code = mhc.COEFF_GRADS.helion_kernel(False).bind(args).to_triton_code(config)
    assert "tl.debug_barrier()" in code[code.index("tl.store(iterates"):code.index("tl.load(iterates")]


# ---------------------------------------------------------------- GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256, 262208])
def test_gpu_real_vocabularies(vocab):
    rows = 512
    x = logits(rows, vocab, torch.bfloat16)
    teacher = logits(rows, vocab, torch.bfloat16)
    probs = torch.softmax(torch.randn(rows, vocab, device=DEVICE) * 2, dim=-1)
    target = labels(rows, vocab, ignored=range(0, rows, 5))
    cases = [
        (ce.ce_loss_and_grad, lambda z: ce_rows(z, target, ignore_index=IGNORE), (target,), {}),
        (jsd.jsd_loss_and_grad, lambda s: jsd_rows(s, teacher, target, beta=0.5, ignore_index=IGNORE),
         (teacher, target), dict(beta=0.5)),
        (kl_div.kl_div_loss_and_grad, lambda s: kl_div_rows(s, probs, target, ignore_index=IGNORE),
         (probs, target), {}),
    ]
    for op, rows_fn, args, kwargs in cases:
        student = logits(rows, vocab, torch.bfloat16, row_stride=vocab + 64)
        student.copy_(x)
        expected = reference(rows_fn, student)
        loss = op(student, *args, ignore_index=IGNORE, **kwargs)
        check_rows_relative(loss, student, *expected)


@pytest.mark.gpu
def test_gpu_row_offsets_past_int32():
    """Three rows 2^30 + 64 elements apart: their offsets pass 2^31 though the view holds only 3 * V values."""
    vocab = 128256
    x = logits(3, vocab, torch.bfloat16, row_stride=2**30 + 64)
    target = labels(3, vocab, ignored=())
    assert _support.needs_int64(x)
    expected = reference(lambda z: ce_rows(z, target, ignore_index=IGNORE), x)
    check_rows_relative(ce.ce_loss_and_grad(x, target, ignore_index=IGNORE), x, *expected)


@pytest.mark.gpu
def test_gpu_mhc_layer():
    hc, channels, rows = 4, 4096, 8192
    k, n = hc * channels, hc * hc + 2 * hc
    params = (torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16),
              (torch.randn(k, n, device=DEVICE) / k**0.5).bfloat16(), torch.randn(n, device=DEVICE),
              *(torch.tensor(v, device=DEVICE) for v in (0.8, 1.1, 0.6)))
    grads = (torch.randn(rows, hc, device=DEVICE), torch.randn(rows, hc, device=DEVICE),
             torch.randn(rows, hc, hc, device=DEVICE))
    got_fwd = mhc.mhc_coeff_fwd(*params, hc=hc)
    got_bwd = mhc.mhc_coeff_bwd(*params, *got_fwd[3:], *grads, hc=hc)
    want_fwd = reference_mhc.mhc_coeff_fwd(*params, hc=hc)
    want_bwd = reference_mhc.mhc_coeff_bwd(*params, *want_fwd[3:], *grads, hc=hc)
    for got, want in zip(got_fwd + got_bwd, want_fwd + want_bwd):
        err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)
        assert err < 2e-2, err


@pytest.mark.gpu
def test_gpu_tables_cover_the_h200_buckets():
    device = torch.device(DEVICE)
    if _support.device_family(device) != "sm90":
        pytest.skip("the committed tables are for sm90")
    for kernel, key in [(ce.KERNEL, 131072), (jsd.MIXTURE, 131072), (kl_div.KERNEL, 131072), (mhc.MIX, (4, 16384))]:
        assert kernel.config(device, torch.bfloat16, key)[1] in ("tuned", "default"), kernel.name
