"""The Hugging Face demo: a tiny Llama (built from a config, random weights, no downloads) learns a synthetic
language with its loss computed by the patched forward (`flce`, no logits) next to an unpatched copy, then a
smaller Llama is distilled from it (TRL's generalized JSD by `fused_linear_jsd`, mixed with hard-label CE).
Prints the losses, checks the first step against the unpatched model, and writes a loss-curve PNG."""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from liger_dispatch import dispatch
from liger_dispatch.capability import dtype_name
from liger_dispatch.integrations.causal_lm import causal_lm_loss
from liger_dispatch.integrations.distillation import generalized_jsd_loss
from liger_dispatch.integrations.transformers import final_hidden_states, patch

HARD_LABEL_WEIGHT = 0.5  # the distillation's alpha: alpha * CE + (1 - alpha) * JSD
SUCCESSORS = 4  # each token of the synthetic language is followed by one of this many tokens
# The PNG goes to the temp dir unless asked otherwise: the demo runs from any directory (a fresh clone, the user's
# own project) and should leave no untracked file in that working tree; it prints where it wrote.
DEFAULT_PNG = Path(tempfile.gettempdir()) / "liger-dispatch-demo.png"


GPU_SIZES = dict(vocab=32000, teacher=(512, 4), student=(256, 2), batch=8, seq=256, lr=1e-3)
CPU_SIZES = dict(vocab=256, teacher=(64, 2), student=(32, 1), batch=8, seq=64, lr=5e-3)


def llama(vocab: int, hidden: int, layers: int, device, dtype):
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 32), num_key_value_heads=max(1, hidden // 64),
                         max_position_embeddings=1024, use_cache=False, bos_token_id=0, eos_token_id=1,
                         pad_token_id=None)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).train()


class MarkovLanguage:
    """Sequences from a random first-order Markov chain: token t is followed by one of SUCCESSORS tokens with
    fixed probabilities, so the best achievable loss is the chain's entropy rate (printed and plotted)."""

    def __init__(self, vocab: int, device, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=gen).to(device)
        self.probs = torch.distributions.Dirichlet(torch.full((SUCCESSORS,), 0.5)).sample((vocab,)).to(device)
        self.vocab, self.device = vocab, device
        self.gen = torch.Generator(device=device).manual_seed(seed + 1)

    def batch(self, batch: int, seq: int) -> torch.Tensor:
        tokens = torch.empty(batch, seq, dtype=torch.long, device=self.device)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), device=self.device, generator=self.gen)
        for t in range(1, seq):
            pick = torch.multinomial(self.probs[tokens[:, t - 1]], 1, generator=self.gen).squeeze(1)
            tokens[:, t] = self.successors[tokens[:, t - 1], pick]
        return tokens

    def entropy_rate(self, tokens: torch.Tensor) -> float:
        """Mean next-token entropy over the given tokens' contexts (nats): the floor of the CE loss."""
        probs = self.probs[tokens[:, :-1]]
        return float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean())


def run(steps: int = 60, device: str = "cpu", dtype: torch.dtype = torch.float32, distill: str = "jsd",
        png: Optional[Path] = None) -> int:
    threads = torch.get_num_threads()
    if not device.startswith("cuda"):  # shapes this small gain nothing from a second thread, and lose 10x on a
        torch.set_num_threads(1)      # busy 2-core machine
    try:
        return _run(steps, device, dtype, distill, DEFAULT_PNG if png is None else png)
    finally:
        torch.set_num_threads(threads)


def _run(steps: int, device: str, dtype: torch.dtype, distill: str, png: Path) -> int:
    torch.manual_seed(0)
    on_gpu = device.startswith("cuda")
    cfg = GPU_SIZES if on_gpu else CPU_SIZES
    beta = 0.5 if distill == "jsd" else 0.0  # TRL's beta: 0 is forward KL(teacher || student)
    print(f"liger-dispatch Hugging Face demo on {device} ({torch.cuda.get_device_name() if on_gpu else 'CPU'}), "
          f"{dtype_name(dtype)}: Llama teacher H={cfg['teacher'][0]} x{cfg['teacher'][1]} layers, student "
          f"H={cfg['student'][0]} x{cfg['student'][1]}, V={cfg['vocab']}, batch {cfg['batch']}x{cfg['seq']}")
    for op in ("flce", "fused_linear_jsd"):
        usable = dispatch.available_backends(op, device=device, dtype=dtype)
        print(f"{op}: auto picks {usable[0]} here (usable, best first: {', '.join(usable)})")
    language = MarkovLanguage(cfg["vocab"], device)
    batches = [language.batch(cfg["batch"], cfg["seq"]) for _ in range(steps)]  # a fresh batch per step
    floor = language.entropy_rate(torch.cat(batches))
    print(f"synthetic language: {SUCCESSORS} successors per token, entropy rate {floor:.3f} nats (the loss floor)")

    teacher = llama(cfg["vocab"], *cfg["teacher"], device, dtype)
    unpatched = copy.deepcopy(teacher)
    patch(teacher)
    ok, served = _check_first_step(teacher, unpatched, batches[0])
    curves = {"patched (flce)": [], "unpatched (transformers)": []}
    start = time.perf_counter()
    for curve, model in zip(curves.values(), (teacher, unpatched)):
        optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
        for tokens in batches:
            loss = model(input_ids=tokens, labels=tokens).loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            curve.append(loss.item())
    patched_curve, unpatched_curve = curves.values()
    gap = max(abs(a - b) / b for a, b in zip(patched_curve, unpatched_curve))
    print(f"teacher: CE {patched_curve[0]:.3f} -> {patched_curve[-1]:.3f} in {steps} steps; "
          f"the unpatched copy's curve differs by at most {gap:.1e} (relative)")

    student = llama(cfg["vocab"], *cfg["student"], device, dtype)
    teacher.eval()
    teacher_weight, student_weight = teacher.lm_head.weight.detach(), student.lm_head.weight
    optim = torch.optim.AdamW(student.parameters(), lr=cfg["lr"])
    distilled = {"divergence": [], "CE": []}
    for step, tokens in enumerate(batches):
        hidden = final_hidden_states(student, input_ids=tokens)
        with torch.no_grad():
            teacher_hidden = final_hidden_states(teacher, input_ids=tokens)
        divergence = generalized_jsd_loss(hidden, student_weight, teacher_hidden, teacher_weight, tokens, beta=beta)
        ce = causal_lm_loss(hidden, student_weight, tokens)
        loss = HARD_LABEL_WEIGHT * ce + (1 - HARD_LABEL_WEIGHT) * divergence
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        distilled["divergence"].append(divergence.item())
        distilled["CE"].append(ce.item())
        if step % max(1, steps // 6) == 0 or step == steps - 1:
            print(f"student step {step:4d}  {distill} {divergence.item():8.4f}  CE {ce.item():8.4f}")
    if on_gpu:
        torch.cuda.synchronize()
    print(f"{3 * steps} training steps in {time.perf_counter() - start:.1f} s")
    caption = (f"liger-dispatch Hugging Face demo: {'GPU' if on_gpu else 'CPU'}, {dtype_name(dtype)}, "
               f"flce served by {served}; python -m liger_dispatch demo")
    _plot(png, curves, distilled, floor, distill, beta, caption)
    print(f"wrote the loss curves to {png.resolve()}")
    return 0 if ok else 1


def _check_first_step(patched, unpatched, tokens) -> tuple[bool, str]:
    """The patched model's first loss and lm_head gradient against the unpatched model's, on the same batch;
    (whether they agree, the backend that served flce)."""
    hidden = final_hidden_states(patched, input_ids=tokens).detach()
    served = dispatch.op("flce").select(hidden.flatten(0, -2), patched.lm_head.weight, tokens.flatten()).backend
    results = []
    for model in (patched, unpatched):
        out = model(input_ids=tokens, labels=tokens)
        (grad,) = torch.autograd.grad(out.loss, model.lm_head.weight)
        results.append((out.loss.detach(), grad, out.logits))
    (loss, grad, logits), (want_loss, want_grad, want_logits) = results
    tolerance = 2e-2 if loss.dtype in (torch.bfloat16, torch.float16) else 1e-4
    errors = [float((a.double() - b.double()).norm() / b.double().norm()) for a, b in ((loss, want_loss),
                                                                                         (grad, want_grad))]
    ok = max(errors) <= tolerance and logits is None and bool(torch.isfinite(grad).all())
    print(f"first step, patched (flce by {served}) vs unpatched: loss rel err {errors[0]:.1e}, lm_head grad rel err "
          f"{errors[1]:.1e}, logits {'not materialized' if logits is None else 'MATERIALIZED'} "
          f"(unpatched: {tuple(want_logits.shape)}) {'ok' if ok else 'MISMATCH'}")
    return ok, served


def _plot(png: Path, curves: dict, distilled: dict, floor: float, distill: str, beta: float, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    fig.suptitle(caption, fontsize=10)
    for (name, curve), style in zip(curves.items(), ("-", "--")):
        left.plot(curve, style, label=name, linewidth=2 if style == "-" else 1.5)
    right.plot(distilled["divergence"], label=f"{distill} to the teacher (TRL beta = {beta})")
    right.plot(distilled["CE"], label="student CE on the labels")
    right.axhline(curves["patched (flce)"][-1], color="black", linestyle="--", linewidth=1,
                  label="teacher CE, last step")
    for ax, title in ((left, "teacher Llama: cross-entropy, patched vs unpatched"),
                      (right, f"student Llama distilled: loss = {HARD_LABEL_WEIGHT} CE + "
                              f"{1 - HARD_LABEL_WEIGHT} {distill}")):
        ax.axhline(floor, color="gray", linestyle=":", label="entropy rate of the data")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("nats")
        ax.legend(fontsize=8)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
