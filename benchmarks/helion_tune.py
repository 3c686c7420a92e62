"""Regenerates the Helion backend's config tables (backends/helion/configs/*.json) on a GPU, in minutes.

For each kernel and shape bucket it runs a short, hand-picked list of candidate configs (block sizes x
num_warps x num_stages, about ten), checks each one's outputs against the reference backend, times it, and
writes the fastest into the table under "<GPU family>/<dtype>/<bucket>". The default config is always timed
first, so the table never holds anything slower than the default; a candidate that fails to compile or gives
wrong numbers is skipped. The whole run is time-boxed (--budget seconds, default 200 — under 4 minutes with
start-up on an H200); jobs the budget does not reach keep their current entries.

Loss kernels are timed as the harness times them (liger_dispatch.timing.bench: CUDA events, L2 flushed, median);
the mHC kernels run for microseconds, where a Python launch would dominate, so they are timed as one CUDA graph's
replays back to back (benchmarks.clocks.graph_us).

    python -m benchmarks.helion_tune                    # tune everything (bf16), write the tables
    python -m benchmarks.helion_tune --only ce_loss_and_grad --dtypes bf16,fp32 --budget 60
    python -m benchmarks.helion_tune --dry-run          # tune and print, write nothing
    python -m benchmarks.helion_tune --write-defaults   # no GPU: defaults for the keys the tables lack

On a GPU host, after `source .devcache/wheels/setup.sh`:
    python3 -m benchmarks.helion_tune --out $OUT/helion-configs
then copy the returned files into backends/helion/configs/ and commit them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from benchmarks import clocks
from benchmarks.shapes import DTYPES
from liger_dispatch import timing
from liger_dispatch.backends.helion import _support as hs
from liger_dispatch.backends.helion import ce, jsd, kl_div, mhc
from liger_dispatch.backends.reference import ce as ref_ce
from liger_dispatch.backends.reference import jsd as ref_jsd
from liger_dispatch.backends.reference import kl_div as ref_kl
from liger_dispatch.backends.reference import mhc as ref_mhc

DEVICE = "cuda"
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-3}  # relative norm of the difference
GRAPH_REPLAYS = 100  # replays of an mHC kernel's graph a timing takes (~1-5 ms of a few-us kernel, best of 3)

VOCABS = (32000, 128256, 151936, 262208)  # Llama 2, Llama 3, Qwen, Gemma: buckets 32768 ... 524288
LOSS_ROWS = 2048
MHC_HC, MHC_ROWS, MHC_CHANNELS = 4, 8192, (1024, 4096)  # B*T = 4*2048 rows of K = HC*C


def _rows_configs(pairs, stages=(1,)):
    return [{"block_sizes": [1, b], "num_warps": w, "num_stages": s} for b, w in pairs for s in stages]


# Candidates: a few block widths around 16 fp32 values a thread, wider/narrower warps, some pipelining.
CE_CANDIDATES = _rows_configs([(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 8), (8192, 16)]) + \
    _rows_configs([(2048, 8), (4096, 8), (8192, 16)], stages=(3,))
TWO_INPUT_CANDIDATES = _rows_configs([(512, 2), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)]) + \
    _rows_configs([(1024, 4), (2048, 8), (4096, 16)], stages=(3,))
MIX_CANDIDATES = [{"block_sizes": [m, k], "num_warps": w, "num_stages": s} for m, k, w, s in [
    (32, 256, 4, 3), (32, 256, 8, 3), (64, 128, 4, 3), (64, 128, 8, 4), (64, 256, 8, 3), (64, 256, 8, 2),
    (128, 128, 8, 3), (128, 256, 8, 2), (64, 512, 8, 2), (16, 256, 4, 4)]]
MM_BACKWARD_CANDIDATES = [{"block_sizes": [k, m], "num_warps": w, "num_stages": s} for k, m, w, s in [
    (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 3),
    (32, 128, 4, 4), (64, 32, 4, 4), (128, 32, 4, 3), (256, 64, 8, 3)]]
ROWS_CANDIDATES = [{"block_sizes": [m], "num_warps": w, "num_stages": 1} for m, w in [
    (8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 4)]]


@dataclass
class Job:
    """One (kernel, dtype, shape bucket): how to build inputs, run the op, and what it must reproduce."""

    kernel: hs.Kernel
    dtype: torch.dtype
    shape_key: object
    shape: str
    candidates: list[dict]
    make: Callable[[torch.dtype], dict]  # fresh inputs
    run: Callable[[dict], tuple]  # the Helion op on inputs (may write into them); returns what to compare
    reference: Callable[[dict], tuple]  # the same through the reference backend
    graphs: bool = False  # time as a CUDA graph (microsecond kernels)
    results: list = field(default_factory=list)


# ---------------------------------------------------------------- jobs


def _logits(rows, vocab, dtype, scale=3.0):
    return (torch.randn(rows, vocab, device=DEVICE) * scale).to(dtype)


def _labels(rows, vocab):
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    labels[::7] = -100
    return labels


def _scale(rows):
    return torch.full((), 1.0 / rows, device=DEVICE)


def _loss_jobs(dtype, only):
    jobs = []
    for vocab in VOCABS:
        key, shape = hs.bucket(vocab), f"{LOSS_ROWS}x{vocab}"

        def ce_inputs(dtype, vocab=vocab):
            return dict(logits=_logits(LOSS_ROWS, vocab, dtype), target=_labels(LOSS_ROWS, vocab),
                        scale=_scale(LOSS_ROWS))

        def ce_run(i, op=ce.ce_loss_and_grad):
            return op(i["logits"], i["target"], grad_scale=i["scale"]), i["logits"]

        def jsd_inputs(dtype, vocab=vocab):
            return dict(student=_logits(LOSS_ROWS, vocab, dtype), teacher=_logits(LOSS_ROWS, vocab, dtype),
                        labels=_labels(LOSS_ROWS, vocab), scale=_scale(LOSS_ROWS))

        def jsd_run(i, op=jsd.jsd_loss_and_grad):
            return op(i["student"], i["teacher"], i["labels"], beta=0.5, temperature=2.0, grad_scale=i["scale"]), \
                i["student"]

        def kl_inputs(dtype, vocab=vocab):
            target = torch.softmax(torch.randn(LOSS_ROWS, vocab, device=DEVICE) * 2, dim=-1).to(dtype)
            return dict(student=_logits(LOSS_ROWS, vocab, dtype), target=target, labels=_labels(LOSS_ROWS, vocab),
                        scale=_scale(LOSS_ROWS))

        def kl_run(i, op=kl_div.kl_div_loss_and_grad):
            return op(i["student"], i["target"], i["labels"], temperature=2.0, grad_scale=i["scale"]), i["student"]

        jobs += [
            Job(ce.KERNEL, dtype, key, shape, CE_CANDIDATES, ce_inputs, ce_run,
                lambda i: ce_run(i, ref_ce.ce_loss_and_grad)),
            Job(jsd.MIXTURE, dtype, key, shape + " beta=0.5", TWO_INPUT_CANDIDATES, jsd_inputs, jsd_run,
                lambda i: jsd_run(i, ref_jsd.jsd_loss_and_grad)),
            Job(kl_div.KERNEL, dtype, key, shape, TWO_INPUT_CANDIDATES, kl_inputs, kl_run,
                lambda i: kl_run(i, ref_kl.kl_div_loss_and_grad)),
        ]
    return [j for j in jobs if only is None or j.kernel.name in only]


def _mhc_inputs(dtype, channels):
    hc, k = MHC_HC, MHC_HC * channels
    n = hc * hc + 2 * hc
    params = dict(x=torch.randn(MHC_ROWS, k, device=DEVICE).to(dtype),
                  phi=(torch.randn(k, n, device=DEVICE) / math.sqrt(k)).to(dtype),
                  b=torch.randn(n, device=DEVICE),
                  alpha_pre=torch.tensor(0.8, device=DEVICE), alpha_post=torch.tensor(1.1, device=DEVICE),
                  alpha_res=torch.tensor(0.6, device=DEVICE))
    fwd = ref_mhc.mhc_coeff_fwd(*params.values(), hc=hc)
    grads = dict(grad_h_pre=torch.randn(MHC_ROWS, hc, device=DEVICE),
                 grad_h_post=torch.randn(MHC_ROWS, hc, device=DEVICE),
                 grad_h_res=torch.randn(MHC_ROWS, hc, hc, device=DEVICE))
    return dict(params=params, saved=dict(mix=fwd[3], rstd=fwd[4]), grads=grads)


def _mhc_fwd(i, op=mhc.mhc_coeff_fwd):
    return op(*i["params"].values(), hc=MHC_HC)


def _mhc_bwd(i, op=mhc.mhc_coeff_bwd):
    return op(*i["params"].values(), *i["saved"].values(), *i["grads"].values(), hc=MHC_HC)


def _mhc_jobs(dtype, only):
    jobs = []
    for channels in MHC_CHANNELS:
        k = MHC_HC * channels
        shape = f"M={MHC_ROWS} K={k} hc={MHC_HC}"

        def make(dtype, channels=channels):
            return _mhc_inputs(dtype, channels)

        jobs += [
            Job(mhc.MIX, dtype, (MHC_HC, hs.bucket(k)), shape, MIX_CANDIDATES, make, _mhc_fwd,
                lambda i: _mhc_fwd(i, ref_mhc.mhc_coeff_fwd), graphs=True),
            Job(mhc.MM_RMS_BACKWARD, dtype, (MHC_HC, hs.bucket(k)), shape, MM_BACKWARD_CANDIDATES, make, _mhc_bwd,
                lambda i: _mhc_bwd(i, ref_mhc.mhc_coeff_bwd), graphs=True),
        ]
    make_small = lambda dtype: _mhc_inputs(dtype, MHC_CHANNELS[0])  # noqa: E731
    shape = f"M={MHC_ROWS} hc={MHC_HC} tmax=20"
    jobs += [
        Job(mhc.COEFFS, dtype, MHC_HC, shape, ROWS_CANDIDATES, make_small, _mhc_fwd,
            lambda i: _mhc_fwd(i, ref_mhc.mhc_coeff_fwd), graphs=True),
        Job(mhc.COEFF_GRADS, dtype, MHC_HC, shape, ROWS_CANDIDATES, make_small, _mhc_bwd,
            lambda i: _mhc_bwd(i, ref_mhc.mhc_coeff_bwd), graphs=True),
    ]
    return [j for j in jobs if only is None or j.kernel.name in only]


# ---------------------------------------------------------------- tuning


def _clone(inputs):
    if isinstance(inputs, dict):
        return {k: _clone(v) for k, v in inputs.items()}
    return inputs.clone() if isinstance(inputs, torch.Tensor) else inputs


def _rel_err(got, want) -> float:
    """The worst of the outputs' relative errors; NaN when one is misshapen or not finite."""
    errs = [timing.rel_err(g.double(), w.double()) for g, w in zip(got, want)]
    return max(errs, key=lambda e: math.inf if math.isnan(e) else e)


def _bench(job: Job, fn) -> float:
    if job.graphs:  # per replay of the kernel captured in a CUDA graph, back to back
        return clocks.graph_us(fn, torch.device(DEVICE), GRAPH_REPLAYS) / 1e3
    return timing.bench(fn, [], torch.device(DEVICE), warmup_ms=10.0, rep_ms=50.0).ms


def tune(job: Job, deadline: float) -> None:
    """Fills job.results with (config, ms or None, error); the default config comes first."""
    inputs = job.make(job.dtype)
    want = job.reference(_clone(inputs))
    default = job.kernel.default_config(job.shape_key)
    candidates = [default] + [c for c in job.candidates if c != default]
    for config in candidates:
        if time.monotonic() > deadline and job.results:
            job.results.append((config, None, "over the time budget"))
            continue
        try:
            with job.kernel.using(config):
                err = _rel_err(job.run(_clone(inputs)), want)
                if not err <= TOLERANCE[job.dtype]:  # NaN too
                    job.results.append((config, None, f"wrong: relative error {err:.1e}"))
                    continue
                timed = _clone(inputs)  # the op writes its gradient into its inputs: time it on a copy
                ms = _bench(job, lambda: job.run(timed))
            job.results.append((config, ms, None))
        except Exception as exc:  # a config that does not compile or launch is skipped, not fatal
            job.results.append((config, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"))
        torch.cuda.empty_cache()


def best(job: Job):
    timed = [(ms, config) for config, ms, _ in job.results if ms is not None]
    return min(timed, key=lambda t: t[0]) if timed else None


def _entry(job: Job, config: dict, source: str, ms=None, default_ms=None) -> dict:
    entry = {"config": config, "source": source, "shape": job.shape}
    if ms is not None:
        entry.update(ms=round(ms, 5), default_ms=round(default_ms, 5), device=torch.cuda.get_device_name(),
                     date=datetime.date.today().isoformat(), torch=torch.__version__)
    return entry


ABOUT = ("Helion configs by '<GPU family>/<dtype>/<shape bucket>', read by backends/helion/_support.py and "
         "written by benchmarks/helion_tune.py. source 'tuned': the measured winner; 'default': the hand-written "
         "default, written out. Keys not listed use the hand-written default.")


def write_tables(entries: dict[str, dict[str, dict]], out: Path) -> None:
    """Merges {kernel name: {key: entry}} into the committed tables, written to `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for name, new in entries.items():
        committed = hs.config_path(name)
        configs = json.loads(committed.read_text())["configs"] if committed.exists() else {}
        configs.update(new)
        path = out / committed.name
        lines = [f"  {json.dumps(key)}: {json.dumps(entry)}" for key, entry in sorted(configs.items())]
        path.write_text("{\n" + f' "kernel": {json.dumps(name)},\n "about": {json.dumps(ABOUT)},\n'
                        + ' "configs": {\n' + ",\n".join(lines) + "\n }\n}\n")


def _all_jobs(dtypes, only):
    return [job for dtype in dtypes for job in _loss_jobs(dtype, only) + _mhc_jobs(dtype, only)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: bf16, fp16, fp32")
    parser.add_argument("--only", default=None, help="comma-separated kernel (table) names")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for the whole tuning run")
    parser.add_argument("--dry-run", action="store_true", help="print the winners, write nothing")
    parser.add_argument("--out", type=Path, default=hs.CONFIG_DIR,
                        help="where the merged tables go (default: the committed ones; on a GPU host whose "
                             "files come back elsewhere, a folder there, then copy them into backends/helion/configs/)")
    parser.add_argument("--write-defaults", action="store_true",
                        help="add the hand-written defaults of the 'sm90' keys the tables lack (no GPU)")
    args = parser.parse_args(argv)
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    only = set(args.only.split(",")) if args.only else None
    jobs = _all_jobs(dtypes, only)

    if args.write_defaults:  # keys the tables lack get the default; tuned entries stay
        entries: dict = {}
        for job in jobs:
            key = hs.config_key("sm90", job.dtype, job.shape_key)
            if key not in hs.config_table(job.kernel.name):
                entries.setdefault(job.kernel.name, {})[key] = _entry(job, job.kernel.default_config(job.shape_key),
                                                                      "default")
        write_tables(entries, args.out)
        print(f"wrote the defaults of {sum(map(len, entries.values()))} missing keys to {args.out}")
        return

    if not torch.cuda.is_available():
        raise SystemExit("helion_tune needs a CUDA device (or --write-defaults)")
    family = hs.device_family(torch.device(DEVICE))
    start = time.monotonic()
    deadline = start + args.budget
    entries = {}
    print(f"{'kernel':22} {'key':22} {'shape':28} {'default ms':>10} {'best ms':>9} {'speedup':>7}  tried  best config")
    for job in jobs:
        tune(job, deadline)
        key = hs.config_key(family, job.dtype, job.shape_key)
        default_ms = job.results[0][1]
        winner = best(job)
        tried = sum(ms is not None for _, ms, _ in job.results)
        if winner is None or default_ms is None:
            print(f"{job.kernel.name:22} {key:22} {job.shape:28} no valid config: {job.results[0][2]}")
            continue
        ms, config = winner
        print(f"{job.kernel.name:22} {key:22} {job.shape:28} {default_ms:10.4f} {ms:9.4f} {default_ms / ms:6.2f}x"
              f"  {tried:>2}/{len(job.results):<2} {json.dumps(config)}")
        for config_, _, error in job.results:
            if error and error != "over the time budget":
                print(f"    skipped {json.dumps(config_)}: {error}")
        entries.setdefault(job.kernel.name, {})[key] = _entry(job, config, "tuned", ms, default_ms)
    elapsed = time.monotonic() - start
    skipped = sum(error == "over the time budget" for job in jobs for _, _, error in job.results)
    print(f"tuning took {elapsed:.0f} s for {len(jobs)} jobs "
          f"({skipped} candidates skipped by the {args.budget:.0f} s budget)")
    if not args.dry_run:
        write_tables(entries, args.out)
        print(f"wrote {sum(map(len, entries.values()))} entries to {args.out}")


if __name__ == "__main__":
    main()
