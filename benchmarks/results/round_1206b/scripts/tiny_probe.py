"""Tiny flce (N=8, H=64, V=256) per provider, fwd+bwd and no_grad wall us, and the kernels of one no_grad call:
where auto's no_grad forward spends its launches, and what the reference would cost if auto picked it there."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from liger_dispatch import dispatch
from benchmarks import clocks

dev = torch.device("cuda")
x = torch.randn(8, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(256, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
y = torch.randint(0, 256, (8,), device=dev)
providers = {"torch": lambda: torch.nn.functional.cross_entropy((x @ w.T).float(), y)}
for b in (None, "reference", "cutedsl", "triton"):
    h = dispatch.op("flce", backend=b) if b else dispatch.op("flce")
    providers[b or "ours"] = (lambda h=h: h(x, w, y))
for name, call in providers.items():
    def step():
        x.grad = w.grad = None
        call().backward()
    def no_grad():
        with torch.no_grad():
            call()
    step(); no_grad()
    print(f"{name:10s} fwd+bwd {clocks.wall_us(step, dev, 300):7.1f} us  no_grad {clocks.wall_us(no_grad, dev, 300):7.1f} us")
    if name in ("ours", "torch", "reference"):
        ks = clocks.kernels(no_grad, dev, 1)
        print("   no_grad kernels:", len(ks), [k[0][:40] for k in ks])
