"""A second CUDA stream for the fused-linear chunk loop: each part's loss kernel overlaps the GEMMs around it.

run_chunks cuts a chunk into PARTS parts of its logits buffer. On the caller's stream (main): part i's logits
GEMM, then, once part i's loss kernel is done (an event), its dX GEMM; dW and db once per chunk over all of its
rows, so there are no more dW read-modify-writes than without overlap, and no more memory (the same buffer).
On the loss stream: part i's loss kernel, after main has written part i's logits (an event). So part i's loss
runs while main computes part i+1's logits or part i-1's dX:

    main:  L0  L1 ......... dX0 dX1 dW db | L0' ...
    loss:      loss0  loss1               |     loss0' ...

No host sync anywhere: the streams meet through events only, which a CUDA graph captures as a fork and a join
(the loss stream first waits on an event of the capturing stream; main waits on the loss stream's last event
before run_chunks returns). The stream is made once per device, outside capture: a call captured before any
eager call on that device runs without overlap. Memory: the loss rows a kernel allocates on the loss stream are
read on main (record_stream(main)); the logits buffer, allocated on main and written on the loss stream, is
marked used there (record_stream), so even an exception between the fork and the join cannot hand it out early.

Inactive (PARTS = 1, everything inline on the caller's stream, exactly the loop without overlap) off CUDA and
unless LIGER_CHUNK_OVERLAP is on (settings.CHUNK_OVERLAP); the GPU measurement decides whether it becomes the default.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from liger_dispatch import settings

PARTS = 2
ROW_ALIGN = 64  # parts start on multiples of 64 rows: GEMM tiles stay whole

_streams: dict[int, torch.cuda.Stream] = {}


def _loss_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """The device's loss stream, made on first use outside graph capture (None while capturing before that).
    High priority: its blocks are scheduled ahead of queued GEMM blocks as SMs free up."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None and not torch.cuda.is_current_stream_capturing():
        low, high = torch.cuda.Stream.priority_range()
        stream = _streams[index] = torch.cuda.Stream(device=index, priority=high)
    return stream


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and settings.CHUNK_OVERLAP.get()


def split(start: int, end: int) -> list[tuple[int, int]]:
    """[start, end) as PARTS row ranges starting on multiples of ROW_ALIGN rows; whole when that is too few rows."""
    if end - start < 2 * ROW_ALIGN:
        return [(start, end)]
    step = -(-(end - start) // (PARTS * ROW_ALIGN)) * ROW_ALIGN
    return [(part_start, min(part_start + step, end)) for part_start in range(start, end, step)]


class LossStream:
    """Runs run_chunks' chunk_loss calls on the loss stream of `device`, or inline when inactive."""

    def __init__(self, device: torch.device):
        self.side = _loss_stream(device) if enabled(device) else None
        self.main = torch.cuda.current_stream(device) if self.side is not None else None

    def parts(self, start: int, end: int) -> list[tuple[int, int]]:
        """The row ranges the chunk [start, end) is cut into: itself when inactive."""
        return [(start, end)] if self.side is None else split(start, end)

    def adopt(self, buffer: torch.Tensor) -> None:
        """Marks a main-stream buffer the loss stream will write (its memory is not reused before that is done)."""
        if self.side is not None:
            buffer.record_stream(self.side)

    def run(self, fn: Callable[..., torch.Tensor], *args) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
        """fn(*args) queued on the loss stream after all main has queued so far: (its result, the event main waits
        on before reading what fn wrote). Inline, with no event, when inactive."""
        if self.side is None:
            return fn(*args), None
        ready = torch.cuda.Event()
        ready.record(self.main)
        self.side.wait_event(ready)
        with torch.cuda.stream(self.side):
            out = fn(*args)
        out.record_stream(self.main)
        done = torch.cuda.Event()
        done.record(self.side)
        return out, done

    def wait(self, done: Optional[torch.cuda.Event]) -> None:
        """Main waits (on the device) for the loss-stream work `done` marks."""
        if done is not None:
            self.main.wait_event(done)
