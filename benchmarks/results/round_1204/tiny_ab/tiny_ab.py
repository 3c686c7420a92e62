"""flce at N=8 H=64 V=256 bf16, auto: per call of 1000 back to back (best of 5), no_grad and fwd+bwd, and torch."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from liger_dispatch import dispatch
label = sys.argv[1]
dev = "cuda"
x = torch.randn(8, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(256, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
y = torch.randint(0, 256, (8,), device=dev)
h = dispatch.op("flce")
def loop(fn, n=1000):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / n * 1e6
def ng_ours():
    with torch.no_grad(): h(x, w, y)
def fb_ours():
    x.grad = w.grad = None; h(x, w, y).backward()
def ng_torch():
    with torch.no_grad(): F.cross_entropy((x @ w.T).float(), y)
def fb_torch():
    x.grad = w.grad = None; F.cross_entropy((x @ w.T).float(), y).backward()
for f in (ng_ours, fb_ours, ng_torch, fb_torch):
    for _ in range(50): f()
for name, f in (("no_grad ours", ng_ours), ("fwd+bwd ours", fb_ours), ("no_grad torch", ng_torch), ("fwd+bwd torch", fb_torch)):
    print(label, name, round(min(loop(f) for _ in range(5)), 1))
