"""liger_dispatch.integrations on tiny Hugging Face models built from configs (random weights, no downloads):
patch() against the unpatched model, the distillation losses against TRL's generalized JSD written out in plain
PyTorch, and benchmarks/hf_step.py's CPU path."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

transformers = pytest.importorskip("transformers")

import liger_dispatch as ld  # noqa: E402
from liger_dispatch.integrations import distillation  # noqa: E402
from liger_dispatch.integrations import transformers as hf  # noqa: E402

VOCAB, HIDDEN = 96, 32  # V not a multiple of any block size
TINY = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# family -> config keywords beyond TINY; Gemma2/3 get a softcap small enough to bend these logits
FAMILIES = {
    "Llama": {},
    "Llama-tied": dict(tie_word_embeddings=True),
    "Mistral": {},
    "Qwen2": {},
    "Qwen3": {},
    "Phi3": {},
    "Gemma": {},
    "Gemma2": dict(final_logit_softcapping=2.0),
    "Gemma3": dict(final_logit_softcapping=2.0),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are too small for a second thread to help; on a busy 2-core machine it costs 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(family: str = "Llama", **overrides):
    name = family.split("-")[0]
    config_class = getattr(transformers, f"{name}TextConfig" if name == "Gemma3" else f"{name}Config")
    config = config_class(**{**TINY, **FAMILIES[family], **overrides})
    return getattr(transformers, f"{name}ForCausalLM")(config).train()


def pair(family: str = "Llama", backend: str = "reference", **overrides):
    """(unpatched, patched copy) of one tiny model."""
    model = tiny_model(family, **overrides)
    return model, hf.patch(copy.deepcopy(model), backend=backend)


def tokens_and_labels(batch=3, seq=12, vocab=VOCAB):
    """Random tokens, and labels = tokens with ignored positions: a prompt prefix in row 0, scattered elsewhere."""
    tokens = torch.randint(3, vocab, (batch, seq))
    labels = tokens.clone()
    labels[0, :5] = -100
    labels[torch.rand(batch, seq) < 0.2] = -100
    return tokens, labels


def assert_same_grads(reference, model, rtol=1e-4):
    names = [n for n, p in reference.named_parameters() if p.requires_grad]
    got = dict(model.named_parameters())
    for name in names:
        want, have = reference.get_parameter(name).grad, got[name].grad
        assert have is not None and torch.isfinite(have).all(), name
        scale = want.abs().max().item()
        torch.testing.assert_close(have, want, rtol=rtol, atol=rtol * scale + 1e-12, msg=name)


@pytest.mark.parametrize("num_items", [None, 23], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_loss_and_every_gradient_equal_unpatched(family, num_items):
    model, patched = pair(family)
    tokens, labels = tokens_and_labels()
    extra = {} if num_items is None else dict(num_items_in_batch=torch.tensor(num_items))
    want = model(tokens, labels=labels, **extra)
    got = patched(tokens, labels=labels, **extra)
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    want.loss.backward()
    got.loss.backward()
    assert_same_grads(model, patched)
    if family.startswith("Gemma") or family.endswith("tied"):  # the head is the embedding: one gradient, both uses
        assert patched.lm_head.weight is patched.get_input_embeddings().weight


@pytest.mark.parametrize("family", ["Llama", "Gemma3"])
def test_without_labels_or_with_return_logits_the_forward_and_generate_are_untouched(family):
    model, patched = pair(family)
    tokens, labels = tokens_and_labels()
    assert torch.equal(patched(tokens).logits, model(tokens).logits)
    want, got = model(tokens, labels=labels), patched(tokens, labels=labels, return_logits=True)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    assert torch.equal(patched(tokens, logits_to_keep=1).logits, model(tokens, logits_to_keep=1).logits)
    model.eval(), patched.eval()
    greedy = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(patched.generate(tokens[:, :5], **greedy), model.generate(tokens[:, :5], **greedy))


@pytest.mark.parametrize("num_items", [None, 23], ids=["mean", "num_items_in_batch"])
def test_return_token_accuracy_adds_liger_kernels_output_field(num_items):
    """out.token_accuracy: the argmax accuracy of the unpatched logits over the positions with a target (a fraction
    with num_items_in_batch too); the loss unchanged; a tuple output ends with it."""
    model, patched = pair("Gemma3")
    tokens, labels = tokens_and_labels()
    extra = {} if num_items is None else dict(num_items_in_batch=torch.tensor(num_items))
    want = model(tokens, labels=labels, **extra)
    targets = labels[:, 1:]
    hits = (want.logits[:, :-1].argmax(-1) == targets) & (targets != -100)
    got = patched(tokens, labels=labels, return_token_accuracy=True, **extra)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.token_accuracy, hits.sum() / (targets != -100).sum())
    assert not got.token_accuracy.requires_grad and got.logits is None
    as_tuple = patched(tokens, labels=labels, return_token_accuracy=True, return_dict=False, **extra)
    assert torch.equal(as_tuple[-1], got.token_accuracy)


def test_lm_head_bias_logits_to_keep_shift_labels_and_tuples_follow_transformers():
    model, patched = pair("Llama")
    for m in (model, patched):  # a head with a bias, the same one in both
        torch.manual_seed(1)
        m.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    tokens, labels = tokens_and_labels()
    mask = torch.rand(tokens.shape) < 0.6
    cases = [
        dict(labels=labels),
        dict(labels=labels[:, -5:], logits_to_keep=5),
        dict(labels=labels[:, 2:9], logits_to_keep=torch.arange(2, 9)),
        dict(labels=labels[mask], logits_to_keep=mask),  # packed: [num_true] positions
        dict(labels=labels, shift_labels=torch.roll(labels, 1, dims=1)),
        dict(labels=labels, return_dict=False),
    ]
    for case in cases:
        model.zero_grad(), patched.zero_grad()
        want, got = model(tokens, **case), patched(tokens, **case)
        want_loss, got_loss = (want[0], got[0]) if isinstance(want, tuple) else (want.loss, got.loss)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
        want_loss.backward(), got_loss.backward()
        assert_same_grads(model, patched)
    assert isinstance(got, tuple) and len(got) == len(want) - 1  # the tuple without the logits


class LargestVocabRows(TorchDispatchMode):
    """Records the most rows of any tensor an op makes whose last dim is the vocabulary ([..., V] logits); views
    (the weight's transpose [H, V], say) alias a tensor some other op made and are skipped."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB:
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


@pytest.mark.parametrize("family", ["Llama", "Gemma3"])
def test_no_batch_by_seq_by_vocab_tensor_when_labels_are_given(family, monkeypatch):
    monkeypatch.setenv("LIGER_CHUNK_ROWS", "8")  # the chunk's [8, V] buffer is the most a patched step may hold
    model, patched = pair(family)
    tokens, labels = tokens_and_labels(batch=4, seq=16)
    for m, most in ((model, 4 * 16), (patched, 8)):
        with LargestVocabRows() as seen:
            m(tokens, labels=labels).loss.backward()
        assert seen.rows == most, (type(m).__name__, seen.rows)  # the unpatched model: the full logits, detected


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["Llama", "Gemma3"])
def test_every_gpu_backend_gives_the_unpatched_loss_and_gradients_in_bf16(family):
    vocab = 32000  # several vocabulary blocks
    model = tiny_model(family, vocab_size=vocab).cuda().to(torch.bfloat16)
    tokens, labels = (t.cuda() for t in tokens_and_labels(batch=4, seq=256, vocab=vocab))
    num_items = torch.tensor(500, device="cuda")
    want = model(tokens, labels=labels, num_items_in_batch=num_items).loss
    want.backward()
    for backend in ld.available_backends("flce", device="cuda", dtype=torch.bfloat16):
        patched = hf.patch(copy.deepcopy(model), backend=backend)
        patched.zero_grad()
        out = patched(tokens, labels=labels, num_items_in_batch=num_items)
        assert out.logits is None
        torch.testing.assert_close(out.loss.float(), want.float(), rtol=2e-2, atol=0, msg=backend)
        out.loss.backward()
        assert_same_grads(model, patched, rtol=5e-2)


def test_autocast_casts_the_head_like_the_unpatched_lm_head():
    model, patched = pair("Llama")
    tokens, labels = tokens_and_labels()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(tokens, labels=labels).loss, patched(tokens, labels=labels).loss
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0)
    want.backward(), got.backward()
    assert_same_grads(model, patched, rtol=5e-2)


def test_four_micro_batches_with_num_items_in_batch_equal_one_batch():
    model, patched = pair("Qwen3")
    tokens, labels = tokens_and_labels(batch=8, seq=10)
    patched(tokens, labels=labels).loss.backward()
    whole = {n: p.grad.clone() for n, p in patched.named_parameters()}
    model(tokens, labels=labels).loss.backward()
    assert_same_grads(model, patched)
    patched.zero_grad()
    num_items = (F.pad(labels, (0, 1), value=-100)[:, 1:] != -100).sum()  # what Trainer passes
    total = 0.0
    for rows in torch.arange(8).chunk(4):
        loss = patched(tokens[rows], labels=labels[rows], num_items_in_batch=num_items).loss
        loss.backward()
        total += loss.detach()
    torch.testing.assert_close(total, model(tokens, labels=labels).loss.detach(), rtol=1e-5, atol=0)
    for name, p in patched.named_parameters():
        torch.testing.assert_close(p.grad, whole[name], rtol=1e-4, atol=1e-4 * whole[name].abs().max().item(),
                                   msg=name)


def test_thirty_steps_of_training_follow_the_unpatched_curve():
    """Stated tolerance: every step's loss within 1e-5 relative (fp32, reference backend; measured 8e-7 on this
    CPU: the two differ only in summation order, and AdamW does not amplify that over 30 steps)."""
    model, patched = pair("Llama")
    curves = []
    for m in (model, patched):
        torch.manual_seed(0)
        optim = torch.optim.AdamW(m.parameters(), lr=1e-2)
        curve = []
        for _ in range(30):
            tokens, labels = tokens_and_labels(batch=4, seq=12)
            labels = (tokens * 5 + 1) % VOCAB  # a learnable rule (token t -> 5t + 1), aligned one position late
            labels = torch.roll(labels, 1, dims=1)
            loss = m(tokens, labels=labels).loss
            optim.zero_grad()
            loss.backward()
            optim.step()
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
    want, got = curves
    assert got[-1] < 0.7 * got[0]  # it learns
    assert ((got - want).abs() / want).max() < 1e-5, (want, got)


@pytest.fixture
def spy_backend(isolated_table):
    """A third-party ce_loss_and_grad backend, 'spy' (never chosen automatically), that records its calls."""
    from liger_dispatch.backends.reference.ce import ce_loss_and_grad

    calls = []

    @ld.register_backend("ce_loss_and_grad", backend="spy", priority=1000, capability=ld.Capability(devices=("cpu",)))
    def spy(logits, target, *, grad_scale=None, ignore_index=-100, label_smoothing=0.0, softcap=None,
            lse_square_scale=0.0, ce_weight=None, row_stats=None):
        calls.append(logits.shape)
        return ce_loss_and_grad(logits, target, grad_scale=grad_scale, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, softcap=softcap, lse_square_scale=lse_square_scale,
                                ce_weight=ce_weight, row_stats=row_stats)

    return calls


def test_backend_preference_reaches_the_loss(spy_backend, monkeypatch):
    tokens, labels = tokens_and_labels()
    hf.patch(tiny_model(), backend="spy")(tokens, labels=labels)
    assert len(spy_backend) == 1
    model = hf.patch(tiny_model())
    model(tokens, labels=labels)
    assert len(spy_backend) == 1  # auto does not pick it
    with ld.use_backend("spy"):
        model(tokens, labels=labels)
    monkeypatch.setenv("LIGER_BACKEND_FLCE", "spy")
    model(tokens, labels=labels)
    assert len(spy_backend) == 3


def test_unsupported_models_are_errors_not_silent_no_ops():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(hf.UnsupportedModelError, match="GPT2LMHeadModel is not a supported causal LM"):
        hf.patch(gpt2)

    class Custom(transformers.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    with pytest.raises(hf.UnsupportedModelError, match="overrides LlamaForCausalLM.forward"):
        hf.patch(Custom(transformers.LlamaConfig(**TINY)))

    tokens, labels = tokens_and_labels()
    model = hf.patch(tiny_model())
    model.loss_function = lambda *args, **kwargs: torch.zeros(())
    with pytest.raises(hf.UnsupportedModelError, match="not transformers' ForCausalLMLoss"):
        model(tokens, labels=labels)
    model = hf.patch(tiny_model())
    model.lm_head = torch.nn.Sequential(model.lm_head)  # as a LoRA wrapper would: the weight alone is not the head
    with pytest.raises(hf.UnsupportedModelError, match="not a torch.nn.Linear"):
        model(tokens, labels=labels)


def test_unpatch_restores_and_a_deep_copy_runs_its_own_weights():
    model = tiny_model()
    tokens, labels = tokens_and_labels()
    hf.patch(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.lm_head.weight.mul_(2)
    assert clone(tokens, labels=labels).logits is None
    assert not torch.equal(clone(tokens, labels=labels).loss, model(tokens, labels=labels).loss)
    hf.unpatch(model)
    assert "forward" not in vars(model) and model(tokens, labels=labels).logits is not None
    with pytest.raises(ValueError, match="not patched"):
        hf.unpatch(model)


# ---------------------------------------------------------------- distillation against TRL


def trl_generalized_jsd(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                        num_items_in_batch=None):
    """TRL's GKDTrainer.generalized_jsd_loss (trl/experimental/gkd/gkd_trainer.py, reduction "batchmean") in
    plain PyTorch. F.kl_div(input, target, log_target=True) is KL(target || input) with both as log-probs."""
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        mixture = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
        jsd = (b * F.kl_div(mixture, t, reduction="none", log_target=True)
               + (1 - b) * F.kl_div(mixture, s, reduction="none", log_target=True))
    if labels is not None:
        jsd = jsd[labels != -100]
    if num_items_in_batch is not None:
        return jsd.sum() / num_items_in_batch
    rows = (labels != -100).sum().clamp_min(1) if labels is not None else jsd.size(0) * jsd.size(1)
    return jsd.sum() / rows


def heads(batch=3, seq=9, student_hidden=24, teacher_hidden=40):
    """Student and teacher hidden states [B, T, H] and head weights [V, H], on a logit scale that matters."""
    hs = torch.randn(batch, seq, student_hidden, requires_grad=True)
    ws = (torch.randn(VOCAB, student_hidden) * 0.5).requires_grad_()
    ht, wt = torch.randn(batch, seq, teacher_hidden), torch.randn(VOCAB, teacher_hidden) * 0.5
    labels = torch.randint(0, VOCAB, (batch, seq))
    labels[0, :4] = -100
    labels[1, 6] = -100
    return hs, ws, ht, wt, labels


def trl_on_logits(hs, ws, ht, wt, labels, **kwargs):
    """TRL's loss on the materialized logits, shifted as GKDTrainer shifts them, in float64."""
    student = (hs.double() @ ws.double().t())[:, :-1]
    teacher = (ht.double() @ wt.double().t())[:, :-1]
    return trl_generalized_jsd(student, teacher, None if labels is None else labels[:, 1:], **kwargs)


def assert_loss_and_student_grads(got, want, tensors, rtol=1e-5):
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-7)
    got_grads = torch.autograd.grad(got, tensors)
    want_grads = torch.autograd.grad(want, tensors)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), w.double(), rtol=rtol * 10, atol=rtol * w.abs().max().item())


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("with_labels", [True, False], ids=["labels", "no-labels"])
def test_generalized_jsd_loss_is_trls(beta, temperature, with_labels):
    hs, ws, ht, wt, labels = heads()
    labels = labels if with_labels else None
    got = distillation.generalized_jsd_loss(hs, ws, ht, wt, labels, beta=beta, temperature=temperature,
                                           backend="reference")
    want = trl_on_logits(hs, ws, ht, wt, labels, beta=beta, temperature=temperature)
    assert_loss_and_student_grads(got, want, (hs, ws))


def test_num_items_in_batch_and_hard_label_mixing_follow_trl_and_cross_entropy():
    hs, ws, ht, wt, labels = heads()
    got = distillation.generalized_jsd_loss(hs, ws, ht, wt, labels, beta=0.5, num_items_in_batch=40,
                                            backend="reference")
    assert_loss_and_student_grads(got, trl_on_logits(hs, ws, ht, wt, labels, num_items_in_batch=40), (hs, ws))

    alpha = 0.25
    got = distillation.generalized_jsd_loss(hs, ws, ht, wt, labels, beta=0.5, temperature=2.0, alpha=alpha,
                                            backend="reference")
    logits = (hs.double() @ ws.double().t())[:, :-1]
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    want = alpha * ce + (1 - alpha) * trl_on_logits(hs, ws, ht, wt, labels, temperature=2.0)
    assert_loss_and_student_grads(got, want, (hs, ws))
    with pytest.raises(ValueError, match="needs labels"):
        distillation.generalized_jsd_loss(hs, ws, ht, wt, None, alpha=0.5)


def test_kl_loss_on_teacher_probabilities_is_trls_beta_zero():
    hs, ws, ht, wt, labels = heads()
    probs = torch.softmax((ht @ wt.t()) / 2.0, dim=-1)
    got = distillation.kl_loss(hs, ws, probs, labels, temperature=2.0, backend="reference")
    assert_loss_and_student_grads(got, trl_on_logits(hs, ws, ht, wt, labels, beta=0.0, temperature=2.0), (hs, ws))


def test_distillation_loss_between_two_models_is_trls_on_their_logits():
    teacher = tiny_model("Llama").eval()
    student = tiny_model("Qwen3", hidden_size=16, num_hidden_layers=1)
    with torch.no_grad():  # initial heads give near-uniform distributions: a divergence of ~1e-3, all rounding
        teacher.lm_head.weight.mul_(30)
        student.lm_head.weight.mul_(30)
    tokens, labels = tokens_and_labels()
    mask = torch.ones_like(tokens)
    got = hf.distillation_loss(student, teacher, labels, beta=0.3, temperature=1.5, backend="reference",
                               input_ids=tokens, attention_mask=mask)
    with torch.no_grad():
        teacher_logits = teacher(tokens, attention_mask=mask).logits[:, :-1].double()
    student_logits = student(tokens, attention_mask=mask).logits[:, :-1].double()
    want = trl_generalized_jsd(student_logits, teacher_logits, labels[:, 1:], beta=0.3, temperature=1.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    got.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.isfinite(p.grad).all() for p in student.parameters())

    with pytest.raises(hf.UnsupportedModelError, match="softcaps its logits"):
        hf.distillation_loss(student, tiny_model("Gemma2"), labels, input_ids=tokens)


def test_hf_step_benchmark_runs_on_a_tiny_config(tmp_path):
    from benchmarks import hf_step

    out = tmp_path / "hf_step.md"
    argv = ["--tiny", "--backends", "reference", "--out", str(out), "--rep-ms", "1", "--warmup-ms", "1"]
    assert hf_step.main(argv) == 0  # the interpreted backends take minutes here: the reference only
    text = out.read_text()
    assert "python -m benchmarks.hf_step --tiny" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    names = [row.split("|")[1].strip() for row in rows]
    assert names[:2] == ["unpatched (transformers)", "patched, reference"]
    assert all(float(row.split("|")[-2]) < 1e-5 for row in rows)  # lm_head gradient as the unpatched one
    assert any("liger-kernel" in line for line in text.splitlines())  # a row, or the note saying why not
