"""Process habits that keep a worker's and a router's event loop answering within a few ms
(their loop-lag probes show it): a frozen start-up heap and short GIL turns.

* CPython's cyclic collector now and then scans the whole heap. A router's heap after
  start-up is ~250k objects (gRPC, aiohttp, the tokenizer, Ray), a worker's more (torch, the
  model): such a scan holds the GIL for 100-300 ms, on whichever thread allocated last,
  the event loop included. :func:`freeze_long_lived` collects once and moves everything
  alive into the permanent generation (as vLLM's engine core does after start-up), so
  later collections scan only what was allocated since: requests, outputs, streams.
  What the first requests load and build (modules imported on first use, Ray's and the
  loop's state for a caller) is long-lived too: :class:`WarmUpFreeze` freezes once more
  the first time the process is idle after its warm-up.
* A thread that wants the GIL waits up to the switch interval (5 ms by default) for the
  thread that holds it, and an event loop takes the GIL back after every system call
  (``epoll``, a socket write, a Ray call): next to an engine thread running Python between
  its kernels, or Ray's threads deserializing, one callback of a few such calls waits tens
  of ms. :func:`short_gil_turns` makes the wait 1 ms; a thread running alone is never
  interrupted, so the engine loses nothing when the loop has nothing to do.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time

GIL_SWITCH_INTERVAL_S = 0.001  # the most a ready event loop waits for another thread


def freeze_long_lived() -> None:
    """Collect garbage once, then exempt every live object from later collections. Call
    after start-up (imports, models, servers made); again later adds what came since."""
    gc.collect()
    gc.freeze()


WARM_UP_REQUESTS = 32  # requests ended before the heap is frozen once more (at an idle moment)


class WarmUpFreeze:
    """Freeze the heap a second time, once: at the first idle moment (no request live) after
    ``after`` requests ended. Then nothing but the live requests' own objects remains for a
    full collection to scan (a served worker: ~10k objects, ~3 ms per full pass, left after
    the start-up freeze). Idle, so no request's objects are frozen with it."""

    __slots__ = ("after", "ended", "done")

    def __init__(self, after: int = WARM_UP_REQUESTS) -> None:
        self.after = after
        self.ended = 0  # requests ended so far (counted until the freeze)
        self.done = False

    def request_ended(self, idle: bool) -> bool:
        """A request ended; ``idle``: none is live now. True when this call froze."""
        if self.done:
            return False
        self.ended += 1
        if not idle or self.ended < self.after:
            return False
        self.done = True
        freeze_long_lived()
        return True


def short_gil_turns(interval_s: float = GIL_SWITCH_INTERVAL_S) -> None:
    """Hand the GIL over to a waiting thread after ``interval_s`` (process-wide), or sooner
    if the interval is shorter already."""
    if sys.getswitchinterval() > interval_s:
        sys.setswitchinterval(interval_s)


LOOP_SLICE_S = 0.002  # the most a loop-side batch of work runs before it yields


class LoopSlices:
    """Cut a long loop-side batch (a burst of requests checked one by one) into turns of at
    most ``budget_s``: ``await slices.tick()`` after each item yields the event loop once the
    turn is spent, so a ready callback (another call, a stream) never waits longer."""

    __slots__ = ("budget_s", "_since", "yields")

    def __init__(self, budget_s: float = LOOP_SLICE_S) -> None:
        self.budget_s = budget_s
        self._since = time.perf_counter()
        self.yields = 0  # times the loop was given back

    async def tick(self) -> None:
        if time.perf_counter() - self._since >= self.budget_s:
            await asyncio.sleep(0)
            self.yields += 1
            self._since = time.perf_counter()
