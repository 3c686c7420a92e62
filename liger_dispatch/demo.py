"""The demo: a small student LM learns from a small teacher (fused-linear JSD or KL) and from the
labels (fused-linear cross-entropy), with an mHC block mixing its residual streams. Prints which
backend served each op and the losses falling, and checks the first step against the reference."""

from __future__ import annotations

import time

import torch

from liger_dispatch import dispatch
from liger_dispatch.nn import FusedLinearCrossEntropyLoss, FusedLinearJSDLoss, FusedLinearKLDivLoss, MHCCoeffs

STREAMS = 4


class Student(torch.nn.Module):
    """Embedding -> residual streams mixed by mHC coefficients around one MLP layer -> LM head."""

    def __init__(self, vocab: int, hidden: int, device, dtype, backend=None):
        super().__init__()
        channels = hidden // STREAMS
        self.embed = torch.nn.Embedding(vocab, hidden, device=device, dtype=dtype)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(channels, 2 * channels, device=device, dtype=dtype),
                                       torch.nn.GELU(),
                                       torch.nn.Linear(2 * channels, channels, device=device, dtype=dtype))
        self.mhc = MHCCoeffs(STREAMS, channels, tmax=8, device=device, dtype=dtype, backend=backend)
        self.norm = torch.nn.RMSNorm(hidden, device=device, dtype=dtype)
        self.head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)

    def hidden(self, tokens):
        x = self.embed(tokens).unflatten(-1, (STREAMS, -1))  # [B, T, HC, C]
        h_pre, h_post, h_res = self.mhc(x)
        layer_in = torch.einsum("bth,bthc->btc", h_pre.to(x.dtype), x)
        layer_out = self.mlp(layer_in)
        x = torch.einsum("btij,btjc->btic", h_res.to(x.dtype), x) + h_post.to(x.dtype)[..., None] * layer_out[..., None, :]
        return self.norm(x.flatten(-2))


def _teacher(vocab, hidden, device, dtype):
    """A fixed teacher whose next-token distribution follows a simple rule (t -> 3t+1 mod V, mostly)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    embed = torch.randn(vocab, hidden, generator=g)
    weight = torch.zeros(vocab, hidden)
    weight[(3 * torch.arange(vocab) + 1) % vocab] = embed * 4.0 / hidden ** 0.5
    weight += 0.1 * torch.randn(vocab, hidden, generator=g)
    return embed.to(device, dtype), weight.to(device, dtype)


def _losses(student, tokens, labels, teacher_embed, teacher_weight, ce, distill, distill_name):
    hidden = student.hidden(tokens).flatten(0, 1)
    teacher_hidden = teacher_embed[tokens].flatten(0, 1) / teacher_embed.shape[1] ** 0.5 * 4.0
    ce_loss = ce(hidden, student.head.weight, labels.flatten())
    if distill_name == "jsd":
        d_loss = distill(hidden, student.head.weight, teacher_hidden, teacher_weight, labels.flatten())
    else:
        probs = torch.softmax((teacher_hidden @ teacher_weight.t()).float(), dim=-1)
        d_loss = distill(hidden, student.head.weight, probs, labels.flatten())
    return ce_loss, d_loss, hidden, teacher_hidden


def _rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run(steps: int = 30, device: str = "cpu", dtype: torch.dtype = torch.float32, distill: str = "jsd") -> int:
    torch.manual_seed(0)
    on_gpu = device.startswith("cuda")
    vocab, hidden, batch, seq = (32000, 1024, 8, 512) if on_gpu else (512, 64, 4, 32)
    print(f"liger-dispatch demo on {device} ({torch.cuda.get_device_name() if on_gpu else 'CPU'}), "
          f"{str(dtype).replace('torch.', '')}: V={vocab} H={hidden} batch={batch}x{seq}, distillation by {distill}")
    student = Student(vocab, hidden, device, dtype)
    teacher_embed, teacher_weight = _teacher(vocab, hidden, device, dtype)
    ce = FusedLinearCrossEntropyLoss(label_smoothing=0.0)
    distill_loss = FusedLinearJSDLoss(jsd_beta=0.5, temperature=2.0) if distill == "jsd" else FusedLinearKLDivLoss()
    optim = torch.optim.AdamW(student.parameters(), lr=3e-3 if on_gpu else 1e-2)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    inputs, labels = tokens[:, :-1], (3 * tokens[:, :-1] + 1) % vocab
    labels[:, :2] = -100  # a few ignored positions, as padding would give

    ok = _check_first_step(student, inputs, labels, teacher_embed, teacher_weight, ce, distill_loss, distill)
    start = time.perf_counter()
    for step in range(steps):
        ce_loss, d_loss, _, _ = _losses(student, inputs, labels, teacher_embed, teacher_weight, ce, distill_loss,
                                        distill)
        loss = ce_loss + d_loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:4d}  ce {ce_loss.item():8.4f}  {distill} {d_loss.item():8.4f}")
    if on_gpu:
        torch.cuda.synchronize()
    print(f"{steps} steps in {time.perf_counter() - start:.2f} s")
    return 0 if ok else 1


def _check_first_step(student, inputs, labels, teacher_embed, teacher_weight, ce, distill_loss, distill) -> bool:
    """Reports the serving backends and compares losses and head gradients with the reference backend."""
    hidden = student.hidden(inputs).flatten(0, 1).detach()
    teacher_hidden = teacher_embed[inputs].flatten(0, 1) / teacher_embed.shape[1] ** 0.5 * 4.0
    x = student.embed(inputs).unflatten(-1, (STREAMS, -1)).detach()
    served = {
        "flce": dispatch.op("flce").select(hidden, student.head.weight, labels.flatten()),
        "mhc_coeffs": dispatch.op("mhc_coeffs").select(x, student.mhc.phi, student.mhc.b, student.mhc.alpha_pre,
                                                       student.mhc.alpha_post, student.mhc.alpha_res),
    }
    if distill == "jsd":
        served["fused_linear_jsd"] = dispatch.op("fused_linear_jsd").select(
            hidden, student.head.weight, teacher_hidden, teacher_weight, labels.flatten())
    for name, impl in served.items():
        print(f"{name:20s} served by {impl.backend} [{impl.variant}]")

    results = {}
    for backend in (None, "reference"):
        ce.__init__(backend=backend)
        distill_loss.__init__(backend=backend, **({"jsd_beta": 0.5, "temperature": 2.0} if distill == "jsd" else {}))
        student.mhc._op = dispatch.op("mhc_coeffs", backend=backend)
        student.zero_grad(set_to_none=True)
        ce_loss, d_loss, _, _ = _losses(student, inputs, labels, teacher_embed, teacher_weight, ce, distill_loss,
                                        distill)
        (ce_loss + d_loss).backward()
        results[backend] = (ce_loss.detach(), d_loss.detach(), student.head.weight.grad.clone(),
                            student.mhc.phi.grad.clone())
    student.zero_grad(set_to_none=True)
    tolerance = 2e-2 if results[None][2].dtype in (torch.bfloat16, torch.float16) else 1e-4
    names = ("ce loss", f"{distill} loss", "head grad", "mhc phi grad")
    ok = True
    for name, got, want in zip(names, results[None], results["reference"]):
        err = _rel_err(got, want)
        good = err <= tolerance and bool(torch.isfinite(got).all())
        ok &= good
        print(f"first step vs reference: {name:12s} rel err {err:.2e} {'ok' if good else 'MISMATCH'}")
    return ok
