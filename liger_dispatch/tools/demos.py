"""`python -m liger_dispatch demo`: its command line, and which demo runs."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama", choices=["llama", "mhc"],
                        help="llama: a tiny Hugging Face Llama trained with the patched loss, then distilled into a "
                             "smaller one (needs the `demo` extra); mhc: a small LM with an mHC block, no extras")
    parser.add_argument("--steps", type=int, help="training steps (default: 60 per phase for llama, 30 for mhc)")
    parser.add_argument("--loss", default="jsd", choices=["jsd", "kl"],
                        help="distillation loss (llama: kl is TRL's beta = 0, forward KL from the teacher's head)")
    parser.add_argument("--png", type=Path, help="where the llama demo writes its loss curves (default: "
                                                 "liger-dispatch-demo.png in the temp dir, outside any working tree)")


def run(args: argparse.Namespace, device: str, dtype: torch.dtype) -> int:
    if args.model == "mhc":
        from liger_dispatch.tools.demo import run as mhc_demo

        return mhc_demo(steps=args.steps or 30, device=device, dtype=dtype, distill=args.loss)
    from liger_dispatch.tools.demo_llama import run as llama_demo

    return llama_demo(steps=args.steps or 60, device=device, dtype=dtype, distill=args.loss, png=args.png)
