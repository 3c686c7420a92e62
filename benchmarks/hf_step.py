"""python -m benchmarks.hf_step: one training step of a Hugging Face Llama, unpatched vs patched vs Liger-Kernel.

The model is Llama-3-8B's shape cut to one decoder layer plus the full head (embedding, one decoder layer, final
norm, lm_head: H=4096, intermediate 14336, 32 heads / 8 KV heads, V=128256, untied), bf16, random weights,
sdpa attention, batch 2 x 4096 tokens with labels = inputs. A step is the forward with labels plus the backward
(no optimizer). The variants run in one process on one model instance, each checked against the unpatched
step first (loss, lm_head gradient):

  unpatched (transformers)     the model's own forward: [2, 4096, V] logits and HF's ForCausalLMLoss
  patched, <backend>           liger_dispatch.integrations.transformers.patch(model, backend=...), for every
                               backend that can serve flce here (the eager reference included)
  liger-kernel, flce only      apply_liger_kernel_to_llama(model=..., fused_linear_cross_entropy only)
  liger-kernel, all kernels    apply_liger_kernel_to_llama(model=...) defaults: also its RoPE, RMSNorm, SwiGLU;
                               last, because it cannot be undone. Skipped, with a note, without liger-kernel.
  ..., torch.compile           with --compile: the unpatched model and ours (auto) again, with
                               model.forward = torch.compile(model.forward)

Time: median (p20-p80) of CUDA-event timings after warm-up (liger_dispatch.timing); peak: max_memory_allocated during one
step above what the weights and inputs hold before it (gradients are freed between steps, so they count).
--tiny: a small config in fp32 on the CPU, timed by the host clock, so CI keeps the script running.

    python -m benchmarks.hf_step --out benchmarks/results/h200_hf_step.md
    python -m benchmarks.hf_step --tiny --out /tmp/hf_step.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shlex
import sys
import traceback
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from benchmarks import clocks
from benchmarks import env as environment
from liger_dispatch import timing

PROG = "python -m benchmarks.hf_step"
UNPATCHED = "unpatched (transformers)"
COLUMNS = ("variant", "step ms", "p20-p80 ms", "peak GB above weights", "time vs unpatched",
           "peak vs unpatched", "loss", "lm_head grad rel err")


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    config: dict  # LlamaConfig keywords (one hidden layer is added)
    batch: int
    seq: int
    dtype: torch.dtype


LLAMA3_8B_LAST_LAYER = Setup(
    "Llama-3-8B shape, one decoder layer + full head",
    dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
         max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    batch=2, seq=4096, dtype=torch.bfloat16)
TINY = Setup(
    "tiny Llama, one decoder layer",
    dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
         max_position_embeddings=64, tie_word_embeddings=False),
    batch=2, seq=32, dtype=torch.float32)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the markdown file to write")
    p.add_argument("--tiny", action="store_true", help="a tiny config in fp32 on the CPU (CI)")
    p.add_argument("--backends", nargs="+", help="our backends to patch with (default: all that can serve flce here)")
    p.add_argument("--warmup-ms", type=float, default=200.0)
    p.add_argument("--rep-ms", type=float, default=1500.0, help="timed repetitions' total time per variant")
    p.add_argument("--compile", action="store_true", help="also the unpatched and the patched (auto) model compiled")
    return p.parse_args(argv)


def build(setup: Setup, device: torch.device):
    import transformers

    config = transformers.LlamaConfig(**setup.config, num_hidden_layers=1, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, config.vocab_size, (setup.batch, setup.seq), device=device,
                           generator=torch.Generator(device=device).manual_seed(1))
    return model.to(setup.dtype).train(), tokens


@contextlib.contextmanager
def unpatched(model) -> Iterator[None]:
    yield


@contextlib.contextmanager
def patched(model, backend: str) -> Iterator[None]:
    from liger_dispatch.integrations.transformers import patch, unpatch

    patch(model, backend=backend)
    try:
        yield
    finally:
        unpatch(model)


@contextlib.contextmanager
def compiled(model, patching: Callable) -> Iterator[None]:
    """model.forward = torch.compile(model.forward) within `patching(model)`, as a user compiles a training step."""
    with patching(model):
        previous = vars(model).get("forward")
        model.forward = torch.compile(model.forward)
        try:
            yield
        finally:
            if previous is None:
                vars(model).pop("forward")
            else:
                model.forward = previous


@contextlib.contextmanager
def liger_flce_only(model) -> Iterator[None]:
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False,
                                swiglu=False, model=model)
    try:
        yield
    finally:
        vars(model).pop("forward", None)  # it sets the instance's forward and nothing else


@contextlib.contextmanager
def liger_all_kernels(model) -> Iterator[None]:
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(model=model)  # swaps modules and module globals: not undone, so it runs last
    yield


def variants(backends: list[str], notes: list[str], compile: bool) -> list[tuple[str, Callable]]:
    rows = [(UNPATCHED, unpatched)]
    rows += [(f"patched, {b}", lambda m, b=b: patched(m, b)) for b in backends]
    if compile:
        rows += [(f"{UNPATCHED}, torch.compile", lambda m: compiled(m, unpatched)),
                 ("patched, auto", lambda m: patched(m, None)),
                 ("patched, auto, torch.compile", lambda m: compiled(m, lambda m: patched(m, None)))]
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as error:
        notes.append(f"liger-kernel: not measured ({error})")
        return rows
    return rows + [("liger-kernel, flce only", liger_flce_only), ("liger-kernel, all kernels", liger_all_kernels)]


@dataclasses.dataclass
class Result:
    loss: float
    head_grad: torch.Tensor
    step: Optional[timing.Timing] = None
    peak_mb: Optional[float] = None


def measure(model, tokens, device: torch.device, args) -> Result:
    params = list(model.parameters())

    def step():
        model(input_ids=tokens, labels=tokens).loss.backward()

    for p in params:
        p.grad = None
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    result = Result(loss.item(), model.lm_head.weight.grad.detach().clone())
    result.step = timing.bench(step, params, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    result.peak_mb = clocks.peak_mb(step, params, device)
    for p in params:
        p.grad = None
    return result


def row(name: str, result: Result, base: Result) -> list[str]:
    rel = ((result.head_grad.float() - base.head_grad.float()).norm() / base.head_grad.float().norm()).item()
    peak = "-" if result.peak_mb is None else f"{result.peak_mb / 1024:.2f}"
    peak_ratio = "-" if result.peak_mb is None else f"{result.peak_mb / base.peak_mb:.2f}x"
    return [name, f"{result.step.ms:.2f}", f"{result.step.p20:.2f}-{result.step.p80:.2f}", peak,
            f"{result.step.ms / base.step.ms:.2f}x", peak_ratio, f"{result.loss:.5f}", f"{rel:.1e}"]


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from liger_dispatch import dispatch
    from liger_dispatch.capability import dtype_name

    setup = TINY if args.tiny else LLAMA3_8B_LAST_LAYER
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    env = environment.collect(device, argv)
    command = " ".join([PROG, *map(shlex.quote, argv)])
    versions = {**env.versions, **{name: environment.version(name) for name in ("transformers", "liger-kernel")}}
    header = " | ".join([env.date, env.gpu, f"driver {env.driver}", *(f"{k} {v}" for k, v in versions.items()),
                         f"`{command}`"])
    print(header)
    model, tokens = build(setup, device)
    backends = args.backends or dispatch.available_backends("flce", device=device, dtype=setup.dtype)
    notes: list[str] = []
    (_, baseline), *others = variants(backends, notes, args.compile)
    print(f"{UNPATCHED} ...", flush=True)
    with baseline(model):
        base = measure(model, tokens, device, args)
    rows = [row(UNPATCHED, base, base)]
    print(" | ".join(rows[-1]), flush=True)
    for name, context in others:
        print(f"{name} ...", flush=True)
        try:
            with context(model):
                result = measure(model, tokens, device, args)
        except Exception as error:  # one variant failing (a peer's version, say) must not lose the others
            notes.append(f"{name}: failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            traceback.print_exc()
            continue
        rows.append(row(name, result, base))
        print(" | ".join(rows[-1]), flush=True)
    cfg = setup.config
    title = (f"One training step (forward + backward) of a Hugging Face Llama: {setup.name} "
             f"(H={cfg['hidden_size']}, V={cfg['vocab_size']}), {dtype_name(setup.dtype)}, "
             f"batch {setup.batch} x {setup.seq}")
    method = "\n\n".join(__doc__.split("\n\n")[1:-1])  # the docstring but its title line and usage
    lines = [f"# {title}", "", header, "", "```text", method, "```", "", "| " + " | ".join(COLUMNS) + " |",
             "|---|" + "---:|" * (len(COLUMNS) - 1), *("| " + " | ".join(r) + " |" for r in rows)]
    lines += ["", *(f"- {note}" for note in notes)] if notes else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
