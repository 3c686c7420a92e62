"""dispatch_overhead: what a call through a `dispatch.op` handle costs on top of the function it selects.

A trivially cheap backend ("bench-noop", returning a preallocated tensor) is registered for flce at
a priority nothing else loses to, so only a handle pinned to it selects it; the handle's per-call
cost (input checks and the memoized selection) is then compared with calling the function directly.
Registration lasts for the process, so this runs after every other op.
"""

from __future__ import annotations

from typing import Callable

import torch

from benchmarks import clocks
from benchmarks.measure import OK, Outcome
from liger_dispatch import timing

NOOP_BACKEND = "bench-noop"
GOAL_NS = 3000
_REPEATS = 7
_LOOP_S = 0.02


def per_call_ns(fn: Callable, args: tuple, device: torch.device) -> timing.Timing:
    """ns per call (in the Timing's fields) over several loops of about _LOOP_S each."""
    calls = max(1, int(_LOOP_S * 1e6 / clocks.loop_us(fn, device, 200, args)))
    return timing.summarize([clocks.loop_us(fn, device, calls, args) * 1e3 for _ in range(_REPEATS)])


def measure(device: torch.device) -> list[tuple[str, Outcome]]:
    import liger_dispatch as ld
    from liger_dispatch import dispatch
    from liger_dispatch.core import selection

    result, empty = torch.ones((), device=device), torch.empty(0, device=device)

    def noop(input, weight, target, bias=None, ce_weight=None, *, ignore_index=-100, reduction="mean",
             label_smoothing=0.0, softcap=None, lse_square_scale=0.0, return_z_loss=False,
             return_token_accuracy=False, accum_dtype=None, process_group=None, need_grads=(), row_weights=None,
             logits_grad=False):
        """flce's signature (the schema, then the implementations' extras): the loss, no statistics, no
        gradients."""
        return result, empty, empty, None, None, None

    ld.register_backend("flce", backend=NOOP_BACKEND, priority=1 << 20,
                        capability=ld.Capability(devices=(device.type,)))(noop)
    gen = torch.Generator(device=device).manual_seed(0)
    args = (torch.randn(8, 16, device=device, generator=gen).bfloat16(),
            torch.randn(32, 16, device=device, generator=gen).bfloat16(),
            torch.randint(0, 32, (8,), device=device, generator=gen))
    handle = dispatch.op("flce", backend=NOOP_BACKEND)
    handle(*args)  # resolves and memoizes the selection
    bare = per_call_ns(noop, args, device)
    through = per_call_ns(handle, args, device)
    selected = per_call_ns(lambda *a: selection.select(handle.name, handle.pinned, a, {}).fn(*a), args, device)

    def note(t: timing.Timing, what: str) -> str:
        extra = t.ms - bare.ms
        verdict = "meets" if extra <= GOAL_NS else "misses"
        return (f"{t.ms:.0f} ns per call = the bare call + {extra:.0f} ns ({t.ms / bare.ms:.1f}x) for {what}; "
                f"{verdict} the goal of <= {GOAL_NS} ns overhead")

    return [("bare call", Outcome(OK, _in_ms(bare), notes=["the noop function called directly"])),
            ("memoized selection", Outcome(OK, _in_ms(selected), notes=[note(selected, "the memoized selection")])),
            ("dispatch.op handle", Outcome(OK, _in_ms(through), notes=[
                note(through, "selection, the memoized input checks and the label-range check (4 launches and no sync "
                              "on the GPU, the host check on the CPU)")]))]


def _in_ms(t: timing.Timing) -> timing.Timing:
    return timing.Timing(t.ms / 1e6, t.p20 / 1e6, t.p80 / 1e6)
