"""The engine's cached KV, lent to another thread while the model computes a step.

A peer pull asks the holder for a run of cached blocks. The holder is, by the time a pull
pays, busy: if the export waited for the step in flight (as every other call waits, between
steps), a long prefill step would cost the pull up to a whole step and the pull would lose
to recomputing. While the model runs its forward, though, the KV manager is at rest (the
scheduler allocated everything the step writes before it started, and nothing is freed or
cached until it ends) and the forward writes only the new slots of its own sequences, never
a full cached block. So a cached block can be pinned, copied out and released meanwhile.

:class:`ForwardWindow` is that rule as a lock: the engine thread holds ``lock`` whenever it
touches the engine (the engine loop takes it with its own lock,
:meth:`~ForwardWindow.held`) and lets go of it only around the forward
(:meth:`~ForwardWindow.open`; an engine stepped without its loop lends nothing); another
thread that holds ``lock`` may read cached blocks through the KV manager's export pins
(``export_run``), and must release every pin before it lets go. The engine thread waits for
it at the end of the forward, so an export holds up a step by at most its copy. On CUDA the
copy is ordered after the forward's kernels on the same stream, which is correct, just not
concurrent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class ForwardWindow:
    """See the module docstring. ``lock`` is held by the engine thread except in :meth:`open`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.opened = 0  # forwards that lent the cache (for tests and stats)
        self._owner: int | None = None  # the thread that holds ``lock`` to run the engine

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold ``lock`` to run the engine (the engine loop, around its drain and step)."""
        with self.lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                self._owner = None

    @contextmanager
    def open(self) -> Iterator[None]:
        """Around the model's forward: lend ``lock`` for the body if this thread holds it
        through :meth:`held` (an engine stepped without its loop lends nothing)."""
        me = threading.get_ident()
        if self._owner != me:
            yield
            return
        self.opened += 1
        self._owner = None
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()
            self._owner = me

    def run(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()`` in the calling thread once ``lock`` is free (the engine is idle or in a
        forward); TimeoutError after ``timeout_s``."""
        if not self.lock.acquire(timeout=max(timeout_s, 0.0)):
            raise TimeoutError(f"the engine lent no forward window within {timeout_s:.3f}s")
        try:
            return fn()
        finally:
            self.lock.release()
