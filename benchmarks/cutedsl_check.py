"""CuTeDSL loss kernels on the GPU: first-call compile time, correctness against fp32 torch autograd, achieved
bandwidth and host launch overhead, then a PASS/FAIL table.

    python benchmarks/cutedsl_check.py              # everything: a few minutes on an H200
    python benchmarks/cutedsl_check.py --quick      # compile + correctness on small shapes only
    python benchmarks/cutedsl_check.py --sweep      # also time launch shapes (threads, unroll, L2 hints)

Every check runs on its own: an exception is printed with its traceback, recorded as FAIL, and the next
check runs. Unless --no-fallback, the quick checks are repeated in a child process without TVM-FFI
(LIGER_CUTEDSL_TVM_FFI=0, the DSL's own executor). Exits 1 if anything failed.

GB/s: "min" counts each input row read once plus the gradient written once (the floor of any such
kernel); "model" counts what the kernel's passes stream (2 passes for ce, kl and jsd beta=0, 3 for
other jsd) if no re-read hits L2.
"""

import argparse
import os
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager

import torch

from liger_dispatch.backends.reference.formulas import ce_rows, jsd_rows, kl_div_rows

DEVICE = "cuda"
RESULTS = []  # (section, name, "PASS" | "FAIL", detail)
TOL = {torch.bfloat16: (2e-3, 2e-2), torch.float16: (1e-3, 4e-3), torch.float32: (1e-4, 2e-4)}  # (loss, grad)


@contextmanager
def check(section, name):
    """Record PASS when the block returns normally (a `detail` list may be appended to), FAIL on any exception."""
    detail = []
    try:
        yield detail
    except Exception as exc:  # noqa: BLE001 - a failing kernel must not hide the others
        traceback.print_exc()
        RESULTS.append((section, name, "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0][:110]))
    else:
        RESULTS.append((section, name, "PASS", "; ".join(detail)))
    sys.stdout.flush()


# ------------------------------------------------------------------------------ the truth: the reference formulas in fp32


def reference(rows_fn, x, others, grad_scale):
    z = x.detach().float().requires_grad_()
    rows = rows_fn(z, *[o.float() if o.is_floating_point() else o for o in others])
    scale = torch.ones_like(rows) if grad_scale is None else grad_scale.float().expand_as(rows)
    (grad,) = torch.autograd.grad(rows, z, scale)
    return rows.detach(), grad


def compare(dtype, loss, grad, ref_loss, ref_grad):
    """(ok, text): loss error relative to max(1, |loss|); gradient error relative to each row's largest entry."""
    tol_loss, tol_grad = TOL[dtype]
    loss_err = ((loss.double() - ref_loss.double()).abs() / ref_loss.double().abs().clamp_min(1.0)).max().item()
    ref = ref_grad.double()
    grad_err = ((grad.double() - ref).abs() / (ref.abs().amax(-1, keepdim=True) + 1e-30)).max().item()
    finite = bool(torch.isfinite(loss).all()) and bool(torch.isfinite(grad).all())
    ok = finite and loss_err <= tol_loss and grad_err <= tol_grad
    return ok, f"loss err {loss_err:.1e}, grad err {grad_err:.1e}{'' if finite else ', NON-FINITE'}"


# ------------------------------------------------------------------------------ the cases


def logits(C, V, dtype, pad=0, scale=3.0):
    """[C, V] of dtype; with pad > 0 a column slice of a wider buffer (row stride V + pad)."""
    return (torch.randn(C, V + pad, device=DEVICE) * scale).to(dtype)[:, :V]


def labels_with_ignored(C, V):
    y = torch.randint(0, V, (C,), device=DEVICE)
    y[1::7] = -100
    return y


def cases(kernels, C, V, dtype, pad=0):
    """(name, kernel fn, make inputs (first = gradient buffer), keyword args, reference rows fn, passes)."""
    ce_fn, jsd_fn, kl_fn = kernels
    row_scale = torch.rand(C, device=DEVICE)
    mean_scale = torch.tensor(1.0 / C, device=DEVICE)
    smooth = dict(label_smoothing=0.1, softcap=30.0, lse_square_scale=1e-4)

    def probs(log=False):
        q = torch.softmax(torch.randn(C, V, device=DEVICE) * 2.0, -1)
        q[0, : V // 3] = 0.0
        return (q.log() if log else q).to(dtype)

    out = [
        ("ce", ce_fn, lambda: (logits(C, V, dtype, pad), labels_with_ignored(C, V)), dict(grad_scale=mean_scale),
         ce_rows, 2),
        ("ce smooth+cap+z", ce_fn, lambda: (logits(C, V, dtype, pad), labels_with_ignored(C, V)),
         dict(grad_scale=row_scale, **smooth), lambda z, y: ce_rows(z, y, **smooth), 2),
    ]
    for beta in (0.0, 0.5, 1.0):
        out.append((f"jsd beta={beta:g}", jsd_fn,
                    lambda: (logits(C, V, dtype, pad), logits(C, V, dtype), labels_with_ignored(C, V)),
                    dict(beta=beta, temperature=2.0, grad_scale=mean_scale.expand(C)),
                    lambda s, t, y, b=beta: jsd_rows(s, t, y, beta=b, temperature=2.0), 2 if beta == 0.0 else 3))
    for log_target in (False, True):
        out.append((f"kl{' log-target' if log_target else ''}", kl_fn,
                    lambda lt=log_target: (logits(C, V, dtype, pad), probs(lt), labels_with_ignored(C, V)),
                    dict(temperature=1.5, log_target=log_target, grad_scale=mean_scale),
                    lambda s, q, y, lt=log_target: kl_div_rows(s, q, y, temperature=1.5, log_target=lt), 2))
    return out


def rows_of(grad_scale, rows):
    """The scales of `rows` (a 0-d scale serves every row)."""
    return grad_scale[rows] if grad_scale is not None and grad_scale.dim() == 1 else grad_scale


def run_case(section, case, C, V, dtype, pad=0, rows=None):
    """Check one case; `rows` limits the reference to those rows (huge shapes). Returns the inputs for timing."""
    name, fn, make, kwargs, rows_fn, _ = case
    tag = f"{name} {str(dtype)[6:]} C={C} V={V}{' stride' if pad else ''}"
    inputs = None
    with check(section, tag) as detail:
        inputs = make()
        x = inputs[0].clone()
        t0 = time.perf_counter()
        loss = fn(x, *inputs[1:], **kwargs)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        pick = slice(None) if rows is None else rows
        ref_loss, ref_grad = reference(rows_fn, inputs[0][pick], [t[pick] for t in inputs[1:]],
                                       rows_of(kwargs.get("grad_scale"), pick))
        ok, text = compare(dtype, loss[pick], x[pick], ref_loss, ref_grad)
        detail.append(text)
        if first > 0.5:
            detail.append(f"first call {first:.2f} s (compile)")
        if not ok:
            raise AssertionError(text)
    return tag, inputs


# ------------------------------------------------------------------------------ sections


def header():
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    props = torch.cuda.get_device_properties(0)
    from liger_dispatch.backends.cutedsl import _support

    print(f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs) "
          f"| torch {torch.__version__} "
          f"| nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')} | apache-tvm-ffi {version('apache-tvm-ffi')} "
          f"| calling convention: {'TVM-FFI' if _support.USE_TVM_FFI else 'DSL executor (no TVM-FFI)'}")


def correctness(kernels, quick):
    shapes = [(5, 1000, torch.bfloat16, 0), (5, 1001, torch.float16, 3), (7, 4099, torch.float32, 0),
              (9, 32003, torch.bfloat16, 5), (3, 262208, torch.float16, 0)]
    if not quick:
        shapes += [(64, 128256, torch.float32, 0), (4096, 128256, torch.bfloat16, 0)]
    for C, V, dtype, pad in shapes:
        for case in cases(kernels, C, V, dtype, pad):
            run_case("correct", case, C, V, dtype, pad)
            torch.cuda.empty_cache()


def large_offsets(kernels):
    """C * V > 2^31 (bf16, 4.3 GB): rows at the end need 64-bit offsets; reference on 4 rows only."""
    C, V = 8200, 262208
    rows = torch.tensor([0, 1, C - 2, C - 1], device=DEVICE)
    for case in cases(kernels, C, V, torch.bfloat16)[:1]:
        run_case("C*V>2^31", case, C, V, torch.bfloat16, rows=rows)
    torch.cuda.empty_cache()


def compile_times():
    """Seconds to compile each kernel's bf16 default variant (the process cache is bypassed)."""
    from liger_dispatch.backends.cutedsl import ce, jsd, kl_div

    bf16, i64 = torch.bfloat16, torch.int64
    keys = {"ce": (ce, (bf16, i64, 8, ce.LAUNCH.default, True, False, False)),
            "jsd beta=0.5": (jsd, (bf16, bf16, i64, 8, jsd.LAUNCH.default, jsd.MIXTURE, True)),
            "kl": (kl_div, (bf16, bf16, i64, 8, kl_div.LAUNCH.default, False, True))}
    for name, (module, key) in keys.items():
        with check("compile", f"{name} bf16 compile time") as detail:
            t0 = time.perf_counter()
            module._compiled.__wrapped__(*key)
            detail.append(f"{time.perf_counter() - t0:.2f} s")


def no_recompile():
    from liger_dispatch.backends.cutedsl import ce

    with check("compile", "new C / V / row stride reuse the compiled ce kernel") as detail:
        y = lambda C, V: torch.randint(0, V, (C,), device=DEVICE)  # noqa: E731
        ce.ce_loss_and_grad(logits(4, 4096, torch.bfloat16), y(4, 4096))
        before = ce._compiled.cache_info().currsize
        for C, V, pad in [(7, 1024, 0), (33, 128256, 0), (2, 8, 0), (5, 2048, 64)]:
            ce.ce_loss_and_grad(logits(C, V, torch.bfloat16, pad), y(C, V))
        after = ce._compiled.cache_info().currsize
        detail.append(f"compiled variants {before} -> {after}")
        assert after == before, "recompiled for a new shape"


def bandwidth(kernels, C, V, dtype, peak):
    from triton.testing import do_bench

    print(f"\nbandwidth: C={C} V={V} {dtype}, peak {peak:.0f} GB/s")
    line = f"{'kernel':<20}{'ms':>8}{'min GB/s':>10}{'% peak':>8}{'model GB/s':>12}"
    print(line + "\n" + "-" * len(line))
    for case in cases(kernels, C, V, dtype):
        name, fn, make, kwargs, _, passes = case
        with check("bandwidth", f"{name} C={C} V={V}") as detail:
            inputs = make()
            fn(*inputs, **kwargs)  # compile outside the timing
            ms = do_bench(lambda: fn(*inputs, **kwargs), warmup=25, rep=200)
            reads = sum(t.numel() * t.element_size() for t in inputs if t.dim() == 2)
            write = inputs[0].numel() * inputs[0].element_size()
            gbs, model = (reads + write) / ms / 1e6, (passes * reads + write) / ms / 1e6
            print(f"{name:<20}{ms:8.3f}{gbs:10.0f}{100 * gbs / peak:7.0f}%{model:12.0f}")
            detail.append(f"{ms:.3f} ms, {gbs:.0f} GB/s ({100 * gbs / peak:.0f}% of peak)")
            inputs = None  # frees the rows before the next size
        torch.cuda.empty_cache()


SWEEP = [(128, 4), (256, 2), (256, 4), (256, 8), (512, 2), (512, 4), (1024, 1), (1024, 2)]


def sweep(kernels, C, V, dtype):
    """Time each kernel under several launch shapes (checked against the reference first); the best is marked."""
    from triton.testing import do_bench

    from liger_dispatch.backends.cutedsl import ce, jsd, kl_div

    launches = {"ce": ce.LAUNCH, "jsd beta=0.5": jsd.LAUNCH, "kl": kl_div.LAUNCH}

    print(f"\nsweep: C={C} V={V} {dtype}: ms per (threads, unroll), with / without L2 hints")
    for case in cases(kernels, C, V, dtype):
        name, fn, make, kwargs, rows_fn, _ = case
        if name not in launches:
            continue
        with check("sweep", f"{name} C={C} V={V}") as detail:
            inputs = make()
            pristine = inputs[0].clone()  # timing overwrites inputs[0] with gradients
            rows = torch.tensor([0, C - 1], device=DEVICE)
            ref_loss, ref_grad = reference(rows_fn, pristine[rows], [t[rows] for t in inputs[1:]],
                                           rows_of(kwargs.get("grad_scale"), rows))
            times = {}
            for threads, unroll in SWEEP:
                for hints in (True, False):
                    with launches[name].using(threads=threads, unroll=unroll, l2_hints=hints) as knobs:
                        x = pristine.clone()
                        loss = fn(x, *inputs[1:], **kwargs)
                        ok, text = compare(dtype, loss[rows], x[rows], ref_loss, ref_grad)
                        if not ok:
                            raise AssertionError(f"{knobs}: {text}")
                        times[knobs] = do_bench(lambda: fn(*inputs, **kwargs), warmup=10, rep=50)
            best = min(times, key=times.get)
            cells = [f"{t.threads}/{t.unroll}{'' if t.l2_hints else ' nohint'} {ms:.3f}{' *' if t == best else ''}"
                     for t, ms in times.items()]
            print(f"  {name:<14}" + " | ".join(cells))
            detail.append(f"best {best.threads}/{best.unroll} hints={best.l2_hints} {times[best]:.3f} ms")
            inputs = None  # frees the rows before the next size
        torch.cuda.empty_cache()


def launch_overhead(kernels, n=2000):
    """Host time per call on a tiny row (GPU time is far below it): through the Python wrapper, and the compiled
    function alone with prepared arguments; a torch in-place add for scale."""
    from liger_dispatch.backends.cutedsl import _support, ce

    print("\nlaunch overhead (host microseconds per call, tiny shape, one sync at the end)")

    def per_call(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    C, V = 1, 256
    x, t = logits(C, V, torch.bfloat16), logits(C, V, torch.bfloat16)
    y = torch.zeros(C, dtype=torch.int64, device=DEVICE)
    q = torch.softmax(logits(C, V, torch.float32), -1).to(torch.bfloat16)
    scale = torch.tensor(1.0, device=DEVICE)
    ce_fn, jsd_fn, kl_fn = kernels
    with check("launch", "host overhead") as detail:
        loss = torch.empty(C, device=DEVICE)
        scale_flat, step = scale.reshape(1), 0
        raw = ce._compiled(torch.bfloat16, torch.int64, 8, ce.LAUNCH.default, True, False, False)
        args = (x, y, loss, scale_flat, step, -100, 0.0, 0.0, 1.0)
        timings = {
            "torch x.add_(1)": per_call(lambda: x.add_(1)),
            "ce compiled fn only": per_call(lambda: raw(*args)),
            "ce_loss_and_grad": per_call(lambda: ce_fn(x, y, grad_scale=scale)),
            "jsd_loss_and_grad": per_call(lambda: jsd_fn(x, t, y, beta=0.5, grad_scale=scale)),
            "kl_div_loss_and_grad": per_call(lambda: kl_fn(x, q, y, grad_scale=scale)),
        }
        if _support.USE_TVM_FFI:  # the DSL's own Python keyword wrapper around the same function
            timings["ce DSL call wrapper"] = per_call(lambda: raw.compiled(*args))
        for name, us in timings.items():
            print(f"  {name:<24}{us:8.1f} us")
        detail.append(", ".join(f"{k.split()[0]} {v:.1f}" for k, v in timings.items() if "torch" not in k) + " us")


def fallback_child():
    env = dict(os.environ, LIGER_CUTEDSL_TVM_FFI="0")
    with check("fallback", "quick checks without TVM-FFI (child process)") as detail:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--quick", "--child"], env=env,
                              capture_output=True, text=True, timeout=900)
        print("\n---- child without TVM-FFI ----")
        print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
        detail.append(f"exit {proc.returncode}")
        assert proc.returncode == 0, f"child exited {proc.returncode}"


def summary():
    print("\n" + "=" * 100)
    width = max(len(name) for _, name, _, _ in RESULTS) + 2
    for section, name, status, detail in RESULTS:
        print(f"{status:<5} {section:<10} {name:<{width}} {detail}")
    failed = sum(status == "FAIL" for _, _, status, _ in RESULTS)
    print(f"{len(RESULTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="compile and check small shapes only")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--peak-gbs", type=float, default=4300.0, help="HBM bandwidth to compare with (GB/s)")
    parser.add_argument("--sweep", action="store_true", help="also time several launch shapes per kernel")
    parser.add_argument("--no-fallback", action="store_true", help="skip the child run without TVM-FFI")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    torch.manual_seed(0)

    kernels = None
    with check("import", "liger_dispatch.backends.cutedsl"):
        from liger_dispatch.backends.cutedsl.ce import ce_loss_and_grad
        from liger_dispatch.backends.cutedsl.jsd import jsd_loss_and_grad
        from liger_dispatch.backends.cutedsl.kl_div import kl_div_loss_and_grad

        kernels = (ce_loss_and_grad, jsd_loss_and_grad, kl_div_loss_and_grad)
        header()
    if kernels is not None:
        compile_times()
        correctness(kernels, args.quick)
        no_recompile()
        launch_overhead(kernels)
        if not args.quick:
            large_offsets(kernels)
            bandwidth(kernels, args.rows, args.vocab, torch.bfloat16, args.peak_gbs)
            if args.sweep:
                sweep(kernels, args.rows, args.vocab, torch.bfloat16)
    if not (args.child or args.no_fallback):
        fallback_child()
    return summary()


if __name__ == "__main__":
    sys.exit(main())
