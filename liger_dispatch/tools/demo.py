"""The demo: a small student LM learns from a small teacher (fused-linear JSD or KL) and from the
labels (fused-linear cross-entropy), with an mHC block mixing its residual streams. Prints which
backend served each op and the losses falling, and checks the first step against the reference."""

from __future__ import annotations

import time

import torch

from liger_dispatch import dispatch
from liger_dispatch.capability import dtype_name
from liger_dispatch.nn import FusedLinearCrossEntropyLoss, FusedLinearJSDLoss, FusedLinearKLDivLoss, MHCCoeffs

STREAMS = 4


class Student(torch.nn.Module):
    """Embedding -> residual streams mixed by mHC coefficients around one MLP layer -> LM head."""

    def __init__(self, vocab: int, hidden: int, device, dtype):
        super().__init__()
        channels, factory = hidden // STREAMS, dict(device=device, dtype=dtype)
        self.embed = torch.nn.Embedding(vocab, hidden, **factory)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(channels, 2 * channels, **factory), torch.nn.GELU(),
                                       torch.nn.Linear(2 * channels, channels, **factory))
        self.mhc = MHCCoeffs(STREAMS, channels, tmax=8, **factory)
        self.norm = torch.nn.RMSNorm(hidden, **factory)
        self.head = torch.nn.Linear(hidden, vocab, bias=False, **factory)

    def hidden(self, tokens):
        x = self.embed(tokens).unflatten(-1, (STREAMS, -1))  # [B, T, HC, C]
        h_pre, h_post, h_res = (h.to(x.dtype) for h in self.mhc(x))
        layer_out = self.mlp(torch.einsum("bth,bthc->btc", h_pre, x))
        x = torch.einsum("btij,btjc->btic", h_res, x) + h_post[..., None] * layer_out[..., None, :]
        return self.norm(x.flatten(-2))


def _teacher(distill: str, tokens, vocab: int, hidden: int, device, dtype) -> tuple:
    """What the distillation loss takes of a fixed teacher for `tokens`: its final hidden states and head weight
    (jsd) or its next-token probabilities (kl). Its distribution follows a simple rule (t -> 3t+1 mod V, mostly)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    embed = torch.randn(vocab, hidden, generator=g)
    weight = torch.zeros(vocab, hidden)
    weight[(3 * torch.arange(vocab) + 1) % vocab] = embed * 4.0 / hidden ** 0.5
    weight += 0.1 * torch.randn(vocab, hidden, generator=g)
    embed, weight = embed.to(device, dtype), weight.to(device, dtype)
    teacher_hidden = embed[tokens].flatten(0, 1) / hidden ** 0.5 * 4.0
    if distill == "jsd":
        return teacher_hidden, weight
    return (torch.softmax((teacher_hidden @ weight.t()).float(), dim=-1),)


def run(steps: int = 30, device: str = "cpu", dtype: torch.dtype = torch.float32, distill: str = "jsd") -> int:
    torch.manual_seed(0)
    on_gpu = device.startswith("cuda")
    vocab, hidden, batch, seq = (32000, 1024, 8, 512) if on_gpu else (512, 64, 4, 32)
    print(f"liger-dispatch demo on {device} ({torch.cuda.get_device_name() if on_gpu else 'CPU'}), "
          f"{dtype_name(dtype)}: V={vocab} H={hidden} batch={batch}x{seq}, distillation by {distill}")
    student = Student(vocab, hidden, device, dtype)
    ce = FusedLinearCrossEntropyLoss(label_smoothing=0.0)
    distill_loss = FusedLinearJSDLoss(jsd_beta=0.5, temperature=2.0) if distill == "jsd" else FusedLinearKLDivLoss()
    optim = torch.optim.AdamW(student.parameters(), lr=3e-3 if on_gpu else 1e-2)
    tokens = torch.randint(0, vocab, (batch, seq + 1), device=device)
    inputs, labels = tokens[:, :-1], (3 * tokens[:, :-1] + 1) % vocab
    labels[:, :2] = -100  # a few ignored positions, as padding would give
    y = labels.flatten()
    distill_args = (*_teacher(distill, inputs, vocab, hidden, device, dtype), y)

    ok = _check_first_step(student, inputs, y, distill_loss, distill, distill_args)
    start = time.perf_counter()
    for step in range(steps):
        states = student.hidden(inputs).flatten(0, 1)
        ce_loss = ce(states, student.head.weight, y)
        d_loss = distill_loss(states, student.head.weight, *distill_args)
        optim.zero_grad(set_to_none=True)
        (ce_loss + d_loss).backward()
        optim.step()
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:4d}  ce {ce_loss.item():8.4f}  {distill} {d_loss.item():8.4f}")
    if on_gpu:
        torch.cuda.synchronize()
    print(f"{steps} steps in {time.perf_counter() - start:.2f} s")
    return 0 if ok else 1


def _check_first_step(student, inputs, y, distill_loss, distill, distill_args) -> bool:
    """Reports the serving backends, and compares their first-step losses, head gradient and mHC
    coefficients with the reference formulas (the eager spec) on the same inputs."""
    from liger_dispatch.backends.reference import formulas

    hidden = student.hidden(inputs).flatten(0, 1).detach()
    head = student.head.weight.detach()
    mhc = student.mhc
    x = student.embed(inputs).unflatten(-1, (STREAMS, -1)).detach()
    mhc_args = (x, *(p.detach() for p in (mhc.phi, mhc.b, mhc.alpha_pre, mhc.alpha_post, mhc.alpha_res)))
    if distill == "jsd":
        distill_op = "fused_linear_jsd"
        distill_kwargs = dict(jsd_beta=distill_loss.jsd_beta, temperature=distill_loss.temperature)
    else:
        distill_op, distill_kwargs = "fused_linear_kl_div", dict(reduction=distill_loss.reduction)
    for name, args in (("flce", (hidden, head, y)), (distill_op, (hidden, head, *distill_args)),
                       ("mhc_coeffs", mhc_args)):
        impl = dispatch.op(name).select(*args)
        print(f"{name:20s} served by {impl.backend} [{impl.variant}]")

    def losses_and_grads(ce_fn, distill_fn, mhc_fn):
        w = head.clone().requires_grad_()
        ce_loss = ce_fn(hidden, w, y)
        d_loss = distill_fn(hidden, w, *distill_args, **distill_kwargs)
        (ce_loss + d_loss).backward()
        phi = mhc.phi.detach().clone().requires_grad_()
        coeffs = mhc_fn(x, phi, *mhc_args[2:], tmax=mhc.tmax)
        sum(c.float().sum() * (i + 1) for i, c in enumerate(coeffs)).backward()
        return ce_loss.detach(), d_loss.detach(), w.grad, torch.cat([c.flatten() for c in coeffs]).detach(), phi.grad

    got = losses_and_grads(dispatch.op("flce"), dispatch.op(distill_op), dispatch.op("mhc_coeffs"))
    want = losses_and_grads(formulas.flce, getattr(formulas, distill_op), formulas.mhc_coeffs)
    tolerance = 2e-2 if head.dtype in (torch.bfloat16, torch.float16) else 1e-3
    ok = True
    for name, g, w in zip(("ce loss", f"{distill} loss", "head grad", "mhc coeffs", "mhc phi grad"), got, want):
        err = float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
        good = err <= tolerance and bool(torch.isfinite(g).all())
        ok &= good
        print(f"first step vs reference formulas: {name:12s} rel err {err:.2e} {'ok' if good else 'MISMATCH'}")
    return ok
