"""Where one step's GPU time goes: each kernel of a provider's call, summed by name, in launch order.

    python -m benchmarks.run kernel-times --op fused_linear_logprobs --n 4096 --providers triton torch.compile
    python -m benchmarks.run kernel-times --op flce --shape tiny --n 16          # the CPU: says there is no profile

A kernel's share is of the step's summed kernel time (torch.profiler, benchmarks.clocks.kernels); the step is
fwd+bwd on the harness's inputs (benchmarks/workloads.py), after two warm-up steps that compile and tune.
"""

import argparse
import sys

import torch

from benchmarks import clocks, providers, shapes, workloads
from liger_dispatch import timing

PROG = "python -m benchmarks.run kernel-times"
NAME_WIDTH = 90


def grouped(events: list[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """(name, launches, us) per kernel name, first launch first."""
    rows: dict[str, list] = {}
    for name, us in events:
        row = rows.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += us
    return [(name, count, us) for name, (count, us) in rows.items()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="fused_linear_logprobs", choices=shapes.HEAD_OPS)
    p.add_argument("--shape", default="llama3", choices=sorted(shapes.LM_PRESETS))
    p.add_argument("--n", type=int, nargs="+", default=[4096])
    p.add_argument("--dtype", default="bf16", choices=sorted(shapes.DTYPES))
    p.add_argument("--providers", nargs="+", default=["ours"])
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        print("kernel-times: no CUDA device, no kernel profile")
        return 0
    dtype = shapes.DTYPES[args.dtype]
    chosen, skipped = providers.resolve(args.op, device, dtype, args.providers)
    for name, reason in skipped:
        print(f"{name}: skipped, {reason}")
    for case in shapes.cases(args.op, [args.shape], args.n, None, [dtype], ["fwd+bwd"]):
        inputs = workloads.make_inputs(case, device, seed=0)
        for provider in chosen:
            fn = provider.build(case)

            def step():
                timing.backward(timing.forward(fn, inputs), inputs)

            for _ in range(2):
                timing.reset_grads(inputs.leaves)
                step()
            rows = grouped(clocks.kernels(step, device, grads=inputs.leaves))
            total = sum(us for _, _, us in rows)
            print(f"\n{args.op} {case.describe()} {args.dtype} fwd+bwd {provider.name}: {total / 1e3:.3f} ms in "
                  f"{sum(c for _, c, _ in rows)} launches")
            for name, count, us in rows:
                print(f"  {us / 1e3:8.3f} ms {100 * us / total:5.1f} % x{count:<3d} {name[:NAME_WIDTH]}")
            del fn
    return 0


if __name__ == "__main__":
    sys.exit(main())
