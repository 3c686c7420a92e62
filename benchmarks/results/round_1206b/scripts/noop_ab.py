"""The noop handle call of each loss op, the same code for any tree (run from its root): host us per call.
python noop_ab.py LABEL CALLS [PROFILE_K]"""
import cProfile, inspect, io, pstats, statistics, sys, time
import os
sys.path.insert(0, os.getcwd())
import torch
import liger_dispatch as ld
from liger_dispatch import dispatch
try:
    from liger_dispatch.core.table import TABLE
    from liger_dispatch.compose.fused_linear import grad_dtype, wanted_grads
except ImportError:
    from liger_dispatch.table import TABLE
    from liger_dispatch.fused_linear import grad_dtype, wanted_grads
from benchmarks import workloads
from benchmarks.shapes import LM_OPS, Case

label, calls = sys.argv[1], int(sys.argv[2])
profile = int(sys.argv[3]) if len(sys.argv) > 3 else 0
device = torch.device("cuda")
DIMS = (("N", 1024), ("H", 1024), ("V", 32000))


def register_noop(op):
    spec = TABLE.spec(op)
    loss = torch.zeros((), device=device)
    made = {}

    def returned(args, need_grads, kwargs):
        a = spec.schema.bind(args, {k: v for k, v in kwargs.items() if k not in spec.extra.names})
        need = wanted_grads(need_grads, len(spec.differentiable))
        tensors = [getattr(a, n) for n in spec.differentiable]
        out = spec.fake(a)
        stats = out[1:] if isinstance(out, tuple) else ()
        return (loss, *(torch.empty_like(t, device=device) for t in stats),
                *(torch.empty(t.shape, dtype=grad_dtype(t), device=device) if w and t is not None else None
                  for w, t in zip(need, tensors)))

    def noop(*args, need_grads=(), **kwargs):
        key = (tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args), tuple(need_grads),
               tuple(kwargs.items()))
        if key not in made:
            made[key] = returned(args, need_grads, kwargs)
        return made[key]

    noop.__signature__ = inspect.Signature([*spec.schema.signature.parameters.values(),
                                            *spec.extra.signature.parameters.values()])
    ld.register_backend(op, backend="noop", priority=1 << 20, capability=ld.Capability(devices=("cuda",)))(noop)


def host_us(fn, n):
    torch.cuda.synchronize()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()  # the stream idle when each call starts
    return statistics.median(samples)


rows = []
for op in LM_OPS:
    register_noop(op)
    case = Case(op, "host", DIMS[0][1], DIMS, torch.bfloat16, "fwd")
    inputs = workloads.make_inputs(case, device, seed=0)
    handle = dispatch.op(op, backend="noop")
    call = lambda: handle(*inputs.args, **inputs.kwargs)
    for _ in range(50):
        call()
    rows.append((op, host_us(call, calls)))
    if profile:
        p = cProfile.Profile()
        p.enable()
        for _ in range(calls):
            call()
        p.disable()
        s = io.StringIO()
        pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(profile)
        print(f"--- {label} {op} profile ({calls} calls)\n{s.getvalue()}")
def wall_us(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


for t, c in (((512, 1024), (2048, 4096)) if os.environ.get("MHC", "1") == "1" else ()):
    dims = (("B", 4), ("T", t), ("HC", 4), ("C", c))
    inputs = workloads.make_inputs(Case("mhc_coeffs", "host", t * c, dims, torch.bfloat16, "fwd+bwd"), device, seed=0)
    for backend in ("triton", "cutedsl", "helion"):
        handle = dispatch.op("mhc_coeffs", backend=backend)

        def step():
            for leaf in inputs.leaves:
                leaf.grad = None
            torch.autograd.backward(handle(*inputs.args, tmax=20), inputs.upstream)

        for _ in range(20):
            step()
        rows.append((f"mhc {t}x{c} {backend} step", host_us(step, calls // 4)))
        rows.append((f"mhc {t}x{c} {backend} wall", min(wall_us(step, calls // 4) for _ in range(3))))
        if profile and backend == "triton" and t == 2048:
            p = cProfile.Profile()
            p.enable()
            for _ in range(calls // 4):
                step()
            p.disable()
            s = io.StringIO()
            pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(profile)
            print(f"--- {label} mhc triton profile ({calls // 4} steps)\n{s.getvalue()}")
for op, us in rows:
    print(f"{label} {op} handle_us {us:.1f}")
