"""python -m benchmarks.run rl-losses: whole RL and preference losses at an LM head, fwd+bwd, ours against the losses
a user would pick instead (liger-kernel's fused ones, torch eager and torch.compile), with the same settings for all.

    python -m benchmarks.run rl-losses                                    # a GPU: llama3 head, N = 1024 4096 16384
    python -m benchmarks.run rl-losses --out benchmarks/results/h200_rl_losses.md
    python -m benchmarks.run rl-losses --losses dpo --shape tiny          # the CPU's default shape: seconds

METHOD below says what each provider computes, with which settings, and how it is checked and timed; the markdown
(--out) starts with it.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks import env as environment
from benchmarks import clocks, measure, peers, report, run, shapes, workloads
from benchmarks.env import version
from benchmarks.providers import COMPILED, EAGER, Provider, compiled_over_rows
from benchmarks.shapes import Case
from liger_dispatch import dispatch
from liger_dispatch.integrations import rl
from liger_dispatch.timing import Inputs

IGNORE_INDEX = workloads.IGNORE_INDEX
OURS, LIGER = "ours", "liger-kernel"
PROVIDERS = (OURS, LIGER, EAGER, COMPILED)
GPU_NS, CPU_NS = (1024, 4096, 16384), (16, 48)
GPU_SEQ_LEN, CPU_SEQ_LEN = 512, 8
GRPO_SETTINGS = {"temperature": 0.9, "beta": 0.04, "epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "dapo"}
DPO_SETTINGS = {"beta": 0.1}


def _said(settings: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in settings.items())


TITLE = "RL and preference losses at an LM head"
METHOD = f"""\
One loss call per row, forward and backward. Time: median (p20-p80) of CUDA-event timings (a host clock on the CPU)
after warm-up, L2 flushed and gradients set to None before every call, outside the timed window. Memory: peak
allocated during one call above what was allocated before it (gradients count, inputs do not). x roofline: time over
the GEMM FLOPs (grpo 6 N H V; dpo 8 N H V, the reference head's forward included) at the bf16 matmul rate of the same
run. Every provider's loss and input and weight gradients are first checked against the same loss in fp32 (logits
materialized from the fp32 upcast of the same inputs): relative norm, bf16 1e-2; FAIL rows are not timed.
N rows = B sequences of T tokens. Providers: ours = fused_linear_logprobs (auto selection) + the loss of
liger_dispatch.integrations.rl; liger-kernel = liger_kernel.chunked_loss's LigerFusedLinearGRPOLoss /
LigerFusedLinearDPOLoss; torch = the logits materialized, log_softmax, the same loss as ours; torch.compile = that,
compiled (B dynamic).
- grpo: TRL's objective, {_said(GRPO_SETTINGS)}: the reference model's per-token
  log-probs (for beta's k3 KL estimate) and the sampling policy's are given, as TRL computes them before the loss;
  completions of T/2 to T tokens.
- dpo: sigmoid, {_said(DPO_SETTINGS)}: B / 2 pairs, chosen and rejected sequences stacked on the batch dimension as
  liger takes them; the reference model's summed log-probs from its own hidden states and head, without gradients,
  inside the call (as liger's use_ref_model computes them); padding (ignore_index) after T/2 to T tokens."""


# ---------------------------------------------------------------- per-token log-probs


def materialized_logps(input, weight, target, temperature=1.0):
    """log softmax(input @ weight.T / temperature)[target], the logits materialized in fp32; 0 at ignored targets."""
    valid = target != IGNORE_INDEX
    logits = (input @ weight.T).float() / temperature
    logps = torch.log_softmax(logits, dim=-1).gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, logps, 0.0)


def fp32_logps(input, weight, target, temperature=1.0):
    """materialized_logps of the fp32 upcast of the inputs: the reference every provider is checked against."""
    return materialized_logps(input.float(), weight.float(), target, temperature)


def fused_logps(input, weight, target, temperature=1.0):
    """Ours: fused_linear_logprobs as a user calls it (its entropy unused, so its backward never reads one)."""
    return dispatch.op("fused_linear_logprobs")(input, weight, target, temperature=temperature)[0]


# ---------------------------------------------------------------- GRPO


def grpo(token_logps, input, weight, tokens, mask, advantages, old_logps, ref_logps, *, temperature, **options):
    """TRL's GRPO loss (integrations.rl.grpo_loss) over the policy's per-token log-probs [B, T]."""
    logps = token_logps(input, weight, tokens, temperature)
    return rl.grpo_loss(logps, old_logps, advantages, mask, ref_per_token_logps=ref_logps, **options)


def liger_grpo() -> Callable:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    def loss(input, weight, tokens, mask, advantages, old_logps, ref_logps, *, temperature, beta, epsilon,
             epsilon_high, loss_type):
        module = LigerFusedLinearGRPOLoss(beta=beta, epsilon_low=epsilon, epsilon_high=epsilon_high,
                                          loss_type=loss_type, temperature=temperature)
        return module(input, weight, tokens, mask, advantages, ref_per_token_logps=ref_logps,
                      old_per_token_logps=old_logps)[0]  # (loss, metrics)

    return loss


def _log_ratios_clear_of_the_clip(shape, device, gen) -> torch.Tensor:
    """log(pi / pi_old) per token, within 0.05 of 0 (inside the clip range) or 0.5 to 1 away (outside it): never near
    the range's edges, where rounding alone decides whether a token is clipped and no tolerance could check it."""
    inside = torch.rand(shape, device=device, generator=gen) < 0.5
    size = torch.rand(shape, device=device, generator=gen)
    sign = torch.randint(0, 2, shape, device=device, generator=gen) * 2 - 1
    return torch.where(inside, 0.05 * size, 0.5 + 0.5 * size) * sign


def _sequences(case: Case, device, gen):
    """(B, T, the policy's hidden states [B, T, H] and head [V, H], tokens [B, T], lengths [B] in T/2..T)."""
    t = case.dim("T")
    b = case.dim("N") // t
    x, w = workloads.lm_head(case, device, gen)
    tokens = torch.randint(0, case.dim("V"), (b, t), device=device, generator=gen)
    lengths = torch.randint(t // 2, t + 1, (b, 1), device=device, generator=gen)
    return b, t, x.view(b, t, -1), w, tokens, lengths


def grpo_inputs(case: Case, device, gen) -> Inputs:
    """Completions with their mask, advantages ~ N(0, 1), the sampling policy's log-probs off the policy's by ratios
    clear of the clip range, the reference model's by N(0, 0.5^2) (a drift whose KL term the check can see)."""
    b, t, x, w, tokens, lengths = _sequences(case, device, gen)
    mask = (torch.arange(t, device=device) < lengths).long()
    advantages = torch.randn(b, device=device, generator=gen)
    with torch.no_grad():
        logps = fp32_logps(x, w, tokens, GRPO_SETTINGS["temperature"])
    old = logps - _log_ratios_clear_of_the_clip(logps.shape, device, gen)
    ref = logps + 0.5 * torch.randn(logps.shape, device=device, generator=gen)
    return Inputs((workloads.leaf(x), workloads.leaf(w), tokens, mask, advantages, old, ref), dict(GRPO_SETTINGS),
                  [x, w])


# ---------------------------------------------------------------- DPO


def dpo(token_logps, input, weight, target, ref_input, ref_weight, *, beta):
    """Sigmoid DPO (integrations.rl.dpo_sigmoid_loss) over summed sequence log-probs; rows [chosen; rejected]."""
    logps = rl.sequence_logps(token_logps(input, weight, target))  # 0 at ignored tokens
    with torch.no_grad():
        ref_logps = rl.sequence_logps(token_logps(ref_input, ref_weight, target))
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    return rl.dpo_sigmoid_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta)


def liger_dpo() -> Callable:
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    def loss(input, weight, target, ref_input, ref_weight, *, beta):
        # Its defaults are the rest of ours: sigmoid, log-probs summed over each sequence, a reference model.
        module = LigerFusedLinearDPOLoss(ignore_index=IGNORE_INDEX, beta=beta)
        return module(weight, input, target, ref_input=ref_input, ref_weight=ref_weight)[0]  # weight first; (loss, aux)

    return loss


def dpo_inputs(case: Case, device, gen) -> Inputs:
    """Padded sequences and a reference model near the policy: its hidden states the policy's + N(0, 0.1^2), its head
    a copy of the policy's."""
    _, t, x, w, target, lengths = _sequences(case, device, gen)
    target.masked_fill_(torch.arange(t, device=device) >= lengths, IGNORE_INDEX)
    ref_x, ref_w = x + workloads.randn(x.shape, x.dtype, device, gen, 0.1), w.clone()  # before x and w need grads
    return Inputs((workloads.leaf(x), workloads.leaf(w), target, ref_x, ref_w), dict(DPO_SETTINGS), [x, w])


# ---------------------------------------------------------------- the losses and their providers


@dataclass(frozen=True)
class Loss:
    """One loss as every provider computes it: formula(token_logps, *inputs.args, **inputs.kwargs) -> a scalar."""

    name: str
    make_inputs: Callable[[Case, torch.device, torch.Generator], Inputs]
    formula: Callable
    liger: Callable[[], Callable]  # -> liger-kernel's loss, the formula's signature without token_logps
    batch_args: tuple[int, ...]  # the positional arguments whose first dimension is B
    gemm: int  # GEMM FLOPs per N H V of a forward and backward
    sequences_per_item: int  # B is a multiple of it (DPO's pairs)

    def workload(self) -> measure.Workload:
        def make_inputs(case, device, seed):
            return self.make_inputs(case, device, torch.Generator(device=device).manual_seed(seed))

        return measure.Workload(make_inputs, lambda case: functools.partial(self.formula, fp32_logps), None)


LOSSES = {
    "grpo": Loss("grpo", grpo_inputs, grpo, liger_grpo, (0, 2, 3, 4, 5, 6), 6, 1),
    "dpo": Loss("dpo", dpo_inputs, dpo, liger_dpo, (0, 2, 3), 8, 2),
}


def providers(loss: Loss, asked: tuple[str, ...]) -> tuple[list[Provider], list[tuple[str, str]]]:
    """(the asked providers that can run, in table order; (name, why not) of the others)."""
    eager = functools.partial(loss.formula, materialized_logps)
    compiled = compiled_over_rows(eager, loss.batch_args)  # built once: its compilation serves every N
    chosen = [Provider(OURS, lambda case: functools.partial(loss.formula, fused_logps),
                       "fused_linear_logprobs, auto selection, + integrations.rl"),
              Provider(EAGER, lambda case: eager), Provider(COMPILED, lambda case: compiled)]
    skipped = []
    if LIGER in asked:
        # liger's chunked losses are torch code (compiled by torch.compile), no Triton: they run on any device.
        why_not = peers.not_installed(LIGER)
        if why_not is None:
            liger = loss.liger()
            chosen.insert(1, Provider(LIGER, lambda case: liger, f"{LIGER} {version(LIGER)}"))
        else:
            skipped.append((LIGER, why_not))
    return [p for p in chosen if p.name in asked], skipped


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run rl-losses", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES))
    p.add_argument("--shape", choices=list(shapes.LM_PRESETS), help="the LM head; none: llama3 on a GPU, tiny on the "
                   "CPU")
    p.add_argument("--n", nargs="+", type=int, help=f"rows, B x T; none: {' '.join(map(str, GPU_NS))} on a GPU, "
                   f"{' '.join(map(str, CPU_NS))} on the CPU")
    p.add_argument("--seq-len", type=int, help=f"T; none: {GPU_SEQ_LEN} on a GPU, {CPU_SEQ_LEN} on the CPU")
    p.add_argument("--dtype", choices=list(shapes.DTYPES), default="bf16")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--out", type=Path, help="markdown file; none: benchmarks/results/<gpu>_rl_losses.md")
    run.add_timing_options(p)
    return p.parse_args(argv)


def _cases(args, device: torch.device, loss: Loss) -> list[Case]:
    gpu = device.type == "cuda"
    head = shapes.LM_PRESETS[args.shape or ("llama3" if gpu else "tiny")]
    t = args.seq_len or (GPU_SEQ_LEN if gpu else CPU_SEQ_LEN)
    cases = []
    for n in sorted(args.n or (GPU_NS if gpu else CPU_NS)):
        if n % (t * loss.sequences_per_item):
            raise SystemExit(f"--n {n}: {loss.name} needs a multiple of {t * loss.sequences_per_item} rows "
                             f"({loss.sequences_per_item} x T = {t})")
        dims = (("N", n), ("H", head.hidden), ("V", head.vocab), ("T", t))
        cases.append(Case(loss.name, head.name, n, dims, shapes.DTYPES[args.dtype], "fwd+bwd"))
    return cases


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    device = run.default_device()
    losses = [LOSSES[name] for name in args.losses]
    # Every loss at a size before the next size: a run cut short by its budget loses the largest sizes.
    plan = sorted(((case, loss) for loss in losses for case in _cases(args, device, loss)), key=lambda c: c[0].n)
    env = environment.collect(device, ["rl-losses", *argv])
    tflops, gbps = clocks.matmul_tflops(device, args.rep_ms), clocks.copy_gbps(device, args.rep_ms)
    print(f"{env.gpu} | driver {env.driver} | matmul {tflops:.0f} TFLOP/s (measured now)")
    settings, history = run.timing_settings(args, device, started), measure.History()
    chosen = {loss.name: providers(loss, tuple(args.providers)) for loss in losses}
    out = args.out or run.RESULTS / f"{env.gpu_short}_rl_losses.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, str]] = []
    status = 0
    try:
        for case, loss in plan:
            roofline_ms = loss.gemm * case.dim("N") * case.dim("H") * case.dim("V") / (tflops * 1e12) * 1e3

            def settle(name: str, outcome: measure.Outcome) -> None:
                rows.append(report.row(case, name, outcome, env, tflops, gbps, roofline_ms))
                print(run.row_line(rows[-1]), flush=True)

            timed, skipped = chosen[loss.name]
            for name, reason in skipped:
                settle(name, measure.Outcome(report.UNAVAILABLE, notes=[reason]))
            measure.measure_case(case, timed, settings, history, lambda p, outcome: settle(p.name, outcome),
                                 loss.workload())
            report.write_markdown(out, rows, title=TITLE, method=METHOD)  # as rows come: a cut run keeps them
    except measure.ContextLost as exc:
        print(f"stopped: {exc}; rerun without that provider (--providers)")
        status = 1
    report.write_markdown(out, rows, title=TITLE, method=METHOD)
    print(out.read_text())
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
