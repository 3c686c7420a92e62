"""Launch knobs: how the Triton and CuTeDSL backends expose a kernel's tuning, outside the op's arguments.

An op's signature is its schema; block sizes, warps, stages and CTA shapes are not part of it. Each kernel-level
op module holds a LaunchKnobs (LAUNCH; FWD_LAUNCH and BWD_LAUNCH for mHC) whose default is a frozen dataclass of
its knobs, and tests and sweeps change them for a block of calls on their own thread:

    with triton.ce.LAUNCH.using(block_size=64):
        triton.ce.ce_loss_and_grad(logits, target)

Helion's counterpart is `Kernel.using(config)` with a whole Helion config. A call reads its knobs once: one
context variable (per thread, and per asyncio task; faster to read than a threading.local attribute), nothing
allocated unless a `using` block is active.
"""

import contextlib
import contextvars
import dataclasses


class LaunchKnobs:
    """The launch knobs of one kernel-level op: a default (a frozen dataclass) and this thread's override."""

    __slots__ = ("name", "default", "_forced")

    def __init__(self, name: str, default):
        self.name, self.default = name, default
        self._forced = contextvars.ContextVar(f"{name} launch knobs", default=None)

    @property
    def forced(self):
        """The knobs a `using` block set on this thread, or None."""
        return self._forced.get()

    @property
    def current(self):
        """The knobs in effect on this thread: the forced ones, else the default."""
        return self.current_or(self.default)

    def current_or(self, default):
        """The forced knobs, else `default`: where the best default depends on the call (one read of the knobs)."""
        knobs = self._forced.get()
        return default if knobs is None else knobs

    @contextlib.contextmanager
    def using(self, **knobs):
        """Launch this thread's calls in the block with these knobs changed (nested blocks change them further)."""
        names = [f.name for f in dataclasses.fields(self.default)]
        unknown = sorted(set(knobs) - set(names))
        if unknown:
            raise TypeError(f"{self.name} has no launch knob {unknown[0]!r} (its knobs: {', '.join(names)})")
        forced = dataclasses.replace(self.current, **knobs)
        token = self._forced.set(forced)
        try:
            yield forced
        finally:
            self._forced.reset(token)


def given(knobs) -> dict:
    """The knobs of a dataclass that are set (not None): what overrides a launch configuration derived per call."""
    return {} if knobs is None else {k: v for k, v in dataclasses.asdict(knobs).items() if v is not None}
