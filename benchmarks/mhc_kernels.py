"""Time the mHC coefficient kernels of each backend at the design's shapes and compare them with the byte floor.

    python -m benchmarks.run mhc-kernels           # triton and cutedsl, B=4, HC=4, T*C = 512*1024 and 2048*4096, bf16
    python -m benchmarks.run mhc-kernels --sweep   # also time each backend's launch-configuration variants
    python -m benchmarks.run mhc-kernels --shapes 4x512x4x1024 --dtype float16

Inputs are what a model feeds the op: x [B, T, HC, C] contiguous (the residual stream), phi in the model
dtype (bf16 parameters, or bf16 copies of fp32 masters), b and the alphas fp32.

Rows (CUDA graphs off):
  fwd            mhc_coeff_fwd                     (kernel level)
  bwd            mhc_coeff_bwd from the saved mix / rstd
  fwd+bwd        the two back to back
  mhc_coeffs fwd the user-level op through dispatch and autograd, forward only (the graph is built and freed)
  mhc_coeffs     the user-level op through dispatch and autograd, forward + torch.autograd.backward
  autograd floor mhc_coeffs through dispatch and autograd on the "floor" backend, stand-ins for the kernel ops that
                 only allocate their outputs: what dispatch, PyTorch's autograd and the allocations cost, whatever
                 the kernels
Columns:
  time us   median wall time of one call (liger_dispatch.timing.bench, L2 flushed before each repetition): what
            the GPU stream spends on the call, idle gaps waiting for the host included
  gpu us    summed durations of the CUDA kernels one call issues (torch.profiler), "launches" their count
  host us   CPU time to issue one call (median, the stream idle at the start): when above gpu us the call is
            host-bound and time us follows it. For mhc_coeffs it includes torch.autograd.backward's Python
            checks of the three upstream gradients, which a training step pays once, not per op.
  floor us  the bytes every implementation must move (x read once forward; x read and grad_x written
            backward; the small tensors) at the copy bandwidth measured in the same run
Each shape is first checked against the float64 formulas (the second of two calls, which launches the kept
compiled kernels directly); a mismatch exits 1.
"""

import argparse
import functools
import importlib
import itertools
import sys
import time

import torch

import liger_dispatch as ld
from benchmarks import clocks
from liger_dispatch import dispatch, timing
from liger_dispatch.backends.reference import mhc as reference_mhc
from liger_dispatch.backends.reference.formulas import mhc_coeffs_from_mix, mhc_mix

TMAX = 20
OPTIONS = dict(tmax=TMAX, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0)
NOMINAL_TBPS = 4.3
DEVICE = "cuda"
WARMUP_MS, REP_MS = 25.0, 100.0  # what triton.testing.do_bench takes by default
# Triton: about 140 variants a shape, 3-4 minutes with compilation: run one shape at a time when the run is time-boxed
SWEEPS = {
    "triton": (
        [dict(BM=bm, BK=bk, split=s, num_warps=w, num_stages=st)
         for bm, bk, s, w, st in itertools.product((16, 32, 64, 128), (64, 128, 256), (1, 2, 4), (4, 8), (4,))]
        + [dict(BM=bm, BK=bk, split=s, num_warps=w, num_stages=st)
           for bm, bk, s, w, st in itertools.product((32, 64), (128, 256), (1, 2), (4, 8), (3, 6))],
        # BR sizes the coefficient producer's row blocks (its Sinkhorn backward), independent of the MM's tiles
        [dict(BM=bm, BK=bk, groups=g, num_warps=w, num_stages=3)
         for bm, bk, g, w in itertools.product((64, 128), (64, 128), (1, 2, 4, 8), (4, 8))]
        + [dict(BR=br) for br in (8, 16, 64)]),
    "cutedsl": (
        [dict(unroll=u, warps_per_sm=w, cols=c) for u, w, c in itertools.product((1, 2), (16, 32), (8, 16, 32))],
        [dict(unroll=u, warps_per_sm=w, max_vec=v) for u, w, v in itertools.product((1, 2), (12, 16, 24), (4, 8))]),
}


def parse_shape(text):
    b, t, hc, c = (int(v) for v in text.lower().split("x"))
    return b, t, hc, c


def make_inputs(b, t, hc, c, dtype):
    k, n = hc * c, hc * hc + 2 * hc
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(b, t, hc, c, device=DEVICE, generator=gen).to(dtype)
    phi = (torch.randn(k, n, device=DEVICE, generator=gen) * k ** -0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE, generator=gen) * 0.1
    alphas = [0.5 + torch.rand((), device=DEVICE, generator=gen) for _ in range(3)]
    upstream = [torch.randn(s, device=DEVICE, generator=gen) for s in ((b, t, hc), (b, t, hc), (b, t, hc, hc))]
    return x, phi, bias, alphas, upstream


def check(mhc, x2, phi, bias, alphas, upstream, hc, dtype):
    """Forward outputs and the six gradients against float64 autograd of the formulas."""
    m = x2.shape[0]
    ups = [u.reshape(m, *u.shape[2:]) for u in upstream]
    for _ in range(2):  # the first call compiles (and Triton's goes through its launcher), the second is direct
        outs = mhc.mhc_coeff_fwd(x2, phi, bias, *alphas, hc=hc, **OPTIONS)
        grads = mhc.mhc_coeff_bwd(x2, phi, bias, *alphas, outs[3], outs[4], *ups, hc=hc, **OPTIONS)
    leaves = [t.detach().double().requires_grad_() for t in (x2, phi, bias, *alphas)]
    mix, rstd = mhc_mix(leaves[0], leaves[1], rms_eps=OPTIONS["rms_eps"])
    coeffs = mhc_coeffs_from_mix(mix, *leaves[2:], hc=hc, tmax=TMAX, pre_eps=OPTIONS["pre_eps"],
                                 sinkhorn_eps=OPTIONS["sinkhorn_eps"], post_mult=OPTIONS["post_mult"])
    want = torch.autograd.grad(coeffs, leaves, [u.double() for u in ups])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    errors = {name: timing.rel_err(g.detach(), w.detach()) for name, g, w in zip(
        ("h_pre", "h_post", "h_res", "mix", "rstd", "grad_x", "grad_phi", "grad_b", "grad_a_pre", "grad_a_post",
         "grad_a_res"), (*outs, *grads), (*coeffs, mix, rstd, *want))}
    bad = {k: v for k, v in errors.items() if not v <= tol}
    worst = max(errors, key=errors.get)
    print(f"  check vs float64: worst {worst} {errors[worst]:.1e}" + (f"  FAILED {bad}" if bad else ""))
    return not bad


def launches(fn, leaves, breakdown=False):
    """(number of CUDA kernels and memsets, their summed duration in us) of one call, gradients reset first."""
    fn()
    kernels = clocks.kernels(fn, torch.device(DEVICE), 1, leaves)
    if breakdown:
        print("    " + ", ".join(f"{name[:40]} {us:.1f}" for name, us in kernels))
    return len(kernels), sum(us for _, us in kernels)


def register_floor_backend(devices=("cuda",)):
    """The "floor" backend: mhc_coeff_fwd / mhc_coeff_bwd stand-ins (the ops' signatures) that allocate their
    outputs and launch nothing; behind every GPU backend in priority, but ahead of the reference (auto tries it
    last), so only where a GPU backend serves is it never auto's pick."""
    floor = dict(backend="floor", priority=1000, capability=ld.Capability(devices=devices))

    @ld.register_backend("mhc_coeff_fwd", **floor)
    @functools.wraps(reference_mhc.mhc_coeff_fwd)
    def fwd(x, phi, b, alpha_pre, alpha_post, alpha_res, *, hc, **options):
        m, n = x.shape[0], hc * hc + 2 * hc
        return tuple(torch.empty(*s, device=x.device) for s in ((m, hc), (m, hc), (m, hc, hc), (m, n), (m,)))

    @ld.register_backend("mhc_coeff_bwd", **floor)
    @functools.wraps(reference_mhc.mhc_coeff_bwd)
    def bwd(x, phi, b, alpha_pre, alpha_post, alpha_res, *saved_and_grads, hc, **options):
        return tuple(torch.empty_like(t) for t in (x, phi, b, alpha_pre, alpha_post, alpha_res))


class TorchFloor(torch.autograd.Function):
    """What PyTorch alone costs under the floor backend: an autograd.Function with mhc_coeffs' inputs, outputs and
    saved tensors that allocates them and does nothing else (no dispatch). x is [B, T, HC, C]."""

    @staticmethod
    def forward(ctx, x, phi, b, alpha_pre, alpha_post, alpha_res):
        rows, hc, n = x.shape[:2], x.shape[2], phi.shape[1]
        mix, rstd = x.new_empty(*rows, n, dtype=torch.float32), x.new_empty(*rows, dtype=torch.float32)
        ctx.save_for_backward(x, phi, b, alpha_pre, alpha_post, alpha_res, mix, rstd)
        return tuple(x.new_empty(*rows, *s, dtype=torch.float32) for s in ((hc,), (hc,), (hc, hc)))

    @staticmethod
    def backward(ctx, *grads):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors[:6])


def floor_bytes(m, k, hc, x_bytes):
    n = hc * hc + 2 * hc
    coeffs = m * (2 * hc + hc * hc) * 4
    fwd = m * k * x_bytes + k * n * x_bytes + coeffs + m * (n + 1) * 4
    bwd = 2 * m * k * x_bytes + 2 * k * n * x_bytes + coeffs + m * (n + 1) * 4 + (n + 3) * 4
    return fwd, bwd


def sweep(name, launch, configs, fn, reference_out):
    """Time fn() with each config of launch knobs set; a config that fails to compile or disagrees with the default
    is shown."""
    rows = []
    for cfg in configs:
        try:
            with launch.using(**cfg):
                out = fn()
                errs = [timing.rel_err(o, r) for o, r in zip(out, reference_out) if r.numel() and r.norm() > 0]
                if not all(e <= 1e-2 for e in errs):  # NaN too
                    rows.append((float("inf"), cfg, f"WRONG ({max(errs):.1e})"))
                    continue
                ms = timing.bench(fn, [], torch.device(DEVICE), warmup_ms=WARMUP_MS, rep_ms=REP_MS).ms
                rows.append((ms, cfg, ""))
        except Exception as exc:  # too much shared memory, say: report and go on
            rows.append((float("inf"), cfg, type(exc).__name__))
    rows.sort(key=lambda r: r[0])
    print(f"  {name} sweep, best 8 of {len(rows)}:")
    for ms, cfg, note in rows[:8]:
        print(f"    {ms * 1e3:8.1f} us  {cfg} {note}")
    failed = [r for r in rows if r[2]]
    if failed:
        print(f"    ({len(failed)} failed or wrong, e.g. {failed[0][1]} {failed[0][2]})")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run mhc-kernels", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[(4, 512, 4, 1024), (4, 2048, 4, 4096)],
                   help="BxTxHCxC")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--backends", nargs="+", default=["triton", "cutedsl"])
    p.add_argument("--breakdown", action="store_true", help="print each kernel's duration in the fwd and bwd rows")
    p.add_argument("--sweep", action="store_true", help="also time each backend's launch configurations")
    args = p.parse_args(argv)
    started = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    tbps = clocks.copy_gbps(torch.device(DEVICE), REP_MS) / 1e3
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {tbps:.2f} TB/s  {args.dtype}  tmax={TMAX}")
    header = (f"  {'':14} {'time us':>9} {'gpu us':>8} {'host us':>8} {'launches':>8} {'floor us':>9} "
              f"{'time/floor':>10}")
    ok = True
    register_floor_backend()
    floor_op = dispatch.op("mhc_coeffs", backend="floor")
    for (b, t, hc, c), backend in itertools.product(args.shapes, args.backends):
        mhc = importlib.import_module(f"liger_dispatch.backends.{backend}.mhc")
        user_op = dispatch.op("mhc_coeffs", backend=backend)
        x, phi, bias, alphas, upstream = make_inputs(b, t, hc, c, dtype)
        m, k = b * t, hc * c
        x2 = x.reshape(m, k)
        ups = [u.reshape(m, *u.shape[2:]) for u in upstream]
        fwd_bytes, bwd_bytes = floor_bytes(m, k, hc, x.element_size())
        gb = (fwd_bytes + bwd_bytes) / 1e9
        print(f"\n{backend}  B={b} T={t} HC={hc} C={c}: M={m} K={k}, floor {gb:.3f} GB "
              f"= {gb / tbps * 1e3:.1f} us at {tbps:.2f} TB/s, {gb / NOMINAL_TBPS * 1e3:.1f} us at {NOMINAL_TBPS}")
        ok &= check(mhc, x2, phi, bias, alphas, upstream, hc, dtype)

        saved = mhc.mhc_coeff_fwd(x2, phi, bias, *alphas, hc=hc, **OPTIONS)

        def fwd():
            return mhc.mhc_coeff_fwd(x2, phi, bias, *alphas, hc=hc, **OPTIONS)

        def bwd():
            return mhc.mhc_coeff_bwd(x2, phi, bias, *alphas, saved[3], saved[4], *ups, hc=hc, **OPTIONS)

        def fwd_bwd():
            out = fwd()
            return mhc.mhc_coeff_bwd(x2, phi, bias, *alphas, out[3], out[4], *ups, hc=hc, **OPTIONS)

        leaves = [t_.detach().requires_grad_() for t_ in (x, phi, bias, *alphas)]

        def user_fwd():
            return user_op(*leaves, **OPTIONS)

        def user():
            torch.autograd.backward(user_op(*leaves, **OPTIONS), upstream)

        def autograd_floor():
            torch.autograd.backward(floor_op(*leaves, **OPTIONS), upstream)

        print(header)
        total = fwd_bytes + bwd_bytes
        for name, fn, floor in (("fwd", fwd, fwd_bytes), ("bwd", bwd, bwd_bytes), ("fwd+bwd", fwd_bwd, total),
                                ("mhc_coeffs fwd", user_fwd, fwd_bytes), ("mhc_coeffs", user, total),
                                ("autograd floor", autograd_floor, total)):
            us = timing.bench(fn, leaves, torch.device(DEVICE), warmup_ms=WARMUP_MS, rep_ms=REP_MS).ms * 1e3
            n_launch, gpu_us = launches(fn, leaves, args.breakdown and name in ("fwd", "bwd"))
            floor_us = floor / (tbps * 1e12) * 1e6
            host_us = clocks.host_us(fn, torch.device(DEVICE), 200, leaves)
            print(f"  {name:14} {us:9.1f} {gpu_us:8.1f} {host_us:8.1f} {n_launch:8d} {floor_us:9.1f} "
                  f"{us / floor_us:10.2f}")
        if args.sweep:
            fwd_configs, bwd_configs = SWEEPS[backend]
            sweep("fwd", mhc.FWD_LAUNCH, fwd_configs, fwd, fwd())
            sweep("bwd", mhc.BWD_LAUNCH, bwd_configs, bwd, bwd())
    print(f"\n{time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
