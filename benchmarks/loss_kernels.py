"""Time each loss kernel of a backend alone on one logits chunk and compare its traffic with the GPU's bandwidth.

    python -m benchmarks.run loss-kernels                       # triton, C=4096, V=128256, bf16
    python -m benchmarks.run loss-kernels --backend cutedsl     # the CuTeDSL kernels
    python -m benchmarks.run loss-kernels --sweep               # also time the backend's launch-knob variants

Each kernel is first checked against the float64 formulas on a few rows (first and last); any mismatch exits 1.
"model GB" is what the kernel's passes move if no pass hits L2 (each pass reads its inputs' rows, each gradient
pass writes the row); "min GB" is the floor of any loss-and-gradient kernel (each input read once, one write).
GB/s above the copy bandwidth means later passes hit L2. Triton's kl rows compare the target read once and twice
(backends/triton/kl_div.py) on fp32 and 16-bit targets, and the fix-up pass a target that does not sum to 1 takes.
Time: liger_dispatch.timing.bench (CUDA events, L2 flushed, median); each call overwrites the logits with their
gradient, as in the composition.
"""

import argparse
import importlib
import sys

import torch

from liger_dispatch import timing
from liger_dispatch.backends.reference.formulas import ce_rows, jsd_rows, kl_div_rows

PROG = "python -m benchmarks.run loss-kernels"
BACKENDS = ("triton", "cutedsl")
CHECK_ROWS = [0, 1, -2, -1]
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
SWEEPS = {  # launch-knob variants a --sweep times, per backend (the LAUNCH knobs of its row kernels)
    "triton": [dict(block_size=b, num_warps=w, num_stages=s) for b, w, s in (
        (4096, 8, 3), (8192, 8, 3), (8192, 16, 1), (8192, 16, 2), (8192, 16, 3), (8192, 32, 3), (16384, 16, 3),
        (16384, 32, 1), (16384, 32, 3), (32768, 32, 1))],
    # split: CTAs (a cluster) a row is cut across, _row.py
    "cutedsl": [dict(threads=t, unroll=u, split=s) for t, u in ((256, 2), (256, 4), (512, 2)) for s in (1, 2, 4, 8)],
}
# kl: (target dtype or None for the logits', mass, target reads); only Triton's kernel can read the target once.
KL_VARIANTS = {"triton": ((torch.float32, 1.0, 1), (torch.float32, 1.0, 2), (torch.float32, 0.9, 1), (None, 1.0, 2),
                          (None, 1.0, 1))}
DEFAULT_KL = ((None, 1.0, 2),)


def cases(C, V, dtype, dev="cuda", backend="triton"):
    """(name, reads, writes, make_inputs, run, reference_rows, launch knobs, the knobs the case sets): reads[k] is
    how many passes read inputs[k] (the 2-D ones), writes how many times the gradient is written; inputs[0] is the
    buffer that receives it."""
    ce, jsd, kl_div = (importlib.import_module(f"liger_dispatch.backends.{backend}.{name}")
                       for name in ("ce", "jsd", "kl_div"))
    ce_loss_and_grad, jsd_loss_and_grad = ce.ce_loss_and_grad, jsd.jsd_loss_and_grad
    kl_div_loss_and_grad = kl_div.kl_div_loss_and_grad

    def logits():
        return torch.randn(C, V, device=dev, dtype=dtype) * 3.0

    def target():
        return torch.randint(0, V, (C,), device=dev)

    def probs(target_dtype, mass=1.0):
        return (torch.softmax(torch.randn(C, V, device=dev) * 3.0, dim=-1) * mass).to(target_dtype)

    scale = torch.tensor(1.0 / C, device=dev)
    opts = dict(label_smoothing=0.1, softcap=30.0, lse_square_scale=1e-4)
    out = [
        ("ce", (2,), 1, lambda: (logits(), target()),
         lambda x, y: ce_loss_and_grad(x, y, grad_scale=scale), lambda x, y: ce_rows(x, y), ce.LAUNCH, {}),
        ("ce smooth+cap+z", (2,), 1, lambda: (logits(), target()),
         lambda x, y: ce_loss_and_grad(x, y, grad_scale=scale, **opts), lambda x, y: ce_rows(x, y, **opts), ce.LAUNCH,
         {}),
    ]
    for beta in (0.0, 0.5, 1.0):
        passes = 3 if beta not in (0.0, 1.0) else 2
        out.append((f"jsd beta={beta:g}", (passes, passes), 1, lambda: (logits(), logits(), target()),
                    lambda s, t, y, b=beta: jsd_loss_and_grad(s, t, y, beta=b, temperature=2.0, grad_scale=scale),
                    lambda s, t, y, b=beta: jsd_rows(s, t, y, beta=b, temperature=2.0), jsd.LAUNCH, {}))
    # kl: the target read twice or once (kl_div.py); "q*0.9" sums to 0.9, so reading it once needs the fix-up pass.
    for target_dtype, mass, reads in KL_VARIANTS.get(backend, DEFAULT_KL):
        target_dtype = target_dtype or dtype
        fixed_up = reads == 1 and (mass != 1.0 or target_dtype.itemsize < 4)
        name = f"kl q={SHORT[target_dtype]}{'*0.9' if mass != 1.0 else ''} {reads}rd{'+fix' if fixed_up else ''}"
        out.append((name, (3, 2) if fixed_up else (2, reads), 2 if fixed_up else 1,
                    lambda td=target_dtype, ms=mass: (logits(), probs(td, ms), target()),
                    lambda s, q, y: kl_div_loss_and_grad(s, q, y, temperature=2.0, grad_scale=scale),
                    lambda s, q, y: kl_div_rows(s, q, y, temperature=2.0), kl_div.LAUNCH,
                    {"target_reads": reads} if backend in KL_VARIANTS else {}))
    return out


def traffic(inputs, reads, writes):
    """(model bytes, minimum bytes) of one call."""
    matrices = [t for t in inputs if t.dim() == 2]
    gradient = inputs[0].numel() * inputs[0].element_size()
    model = sum(r * t.numel() * t.element_size() for r, t in zip(reads, matrices)) + writes * gradient
    return model, sum(t.numel() * t.element_size() for t in matrices) + gradient


def check(name, inputs, run, reference_rows, scale):
    """Run once on a copy and compare CHECK_ROWS with the float64 formulas; False (and a message) on mismatch."""
    rows = torch.tensor(CHECK_ROWS, device=inputs[0].device) % inputs[0].shape[0]
    picked = [t[rows] for t in inputs]
    x64 = picked[0].double().requires_grad_()
    expected = reference_rows(x64, *picked[1:])
    (expected_grad,) = torch.autograd.grad(expected, x64, torch.full_like(expected, scale))
    x = inputs[0].clone()
    loss = run(x, *inputs[1:])
    loss_err = (loss[rows].double() - expected.detach()).abs().max().item()
    grad_err = (x[rows].double() - expected_grad).abs() / (expected_grad.abs() + 1e-3 * expected_grad.abs().max())
    grad_err = grad_err.max().item()
    ok = loss_err <= 1e-3 and grad_err <= 2e-2
    if not ok:
        print(f"MISMATCH {name}: max |loss err| {loss_err:.3e}, max rel grad err {grad_err:.3e}", file=sys.stderr)
    return ok


def main(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton", choices=BACKENDS)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--peak-gbs", type=float, default=4300.0, help="HBM bandwidth to compare with (GB/s)")
    parser.add_argument("--sweep", action="store_true", help="also time the backend's launch-knob variants")
    parser.add_argument("--rep-ms", type=float, default=200.0, help="timed repetitions' total time per kernel")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{PROG}: needs a CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs | torch {torch.__version__} | {args.backend} | "
          f"C={args.rows} V={args.vocab} {args.dtype} | peak {args.peak_gbs:.0f} GB/s")

    all_ok = True
    header = f"{'kernel':<22}{'config':>18}{'ms':>9}{'model GB':>10}{'GB/s':>8}{'% peak':>8}{'min GB':>8}{'GB/s':>8}"
    print(header)
    print("-" * len(header))
    for name, reads, writes, make, run, reference_rows, launch, case_knobs in cases(args.rows, args.vocab, dtype,
                                                                                   backend=args.backend):
        inputs = make()
        model, minimum = traffic(inputs, reads, writes)
        for knobs in [{}] + (SWEEPS[args.backend] if args.sweep else []):
            label = "/".join(str(v) for v in knobs.values()) or "default"
            with launch.using(**case_knobs, **knobs):
                try:
                    ok = check(f"{name} {label}", inputs, run, reference_rows, 1.0 / args.rows)
                    ms = timing.bench(lambda: run(*inputs), [], device, warmup_ms=25.0, rep_ms=args.rep_ms).ms
                except Exception as e:  # a sweep point too large for this GPU (out of resources), say
                    print(f"{name:<22}{label:>18}  skipped: {type(e).__name__}: {str(e)[:80]}")
                    all_ok &= bool(knobs)  # the default launch must run
                    continue
            all_ok &= ok
            gbs = model / ms / 1e6
            print(f"{name:<22}{label:>18}{ms:9.3f}{model / 1e9:10.2f}{gbs:8.0f}{100 * gbs / args.peak_gbs:7.0f}%"
                  f"{minimum / 1e9:8.2f}{minimum / ms / 1e6:8.0f}{'' if ok else '  MISMATCH'}")
        inputs = None  # frees the rows before the next size
        torch.cuda.empty_cache()
    if not all_ok:
        print("FAILED: at least one kernel does not match the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
