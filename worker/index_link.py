"""The worker's link to the Redis index: its publisher (``kvstore/publisher.py``, whose thread
is the only one that talks to Redis), the spares the index names applied between steps, the
pool's cached keys for a resync, and a resync a router asks for."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kvstore.blocks.events import KVEvent
from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from kvstore.index_sync import SPARES_DUTY
from kvstore.index_types import WorkerLoad
from kvstore.publisher import WorkerPublisher
from kvstore.recorder import TierKeys
from worker.engine.commands import CachedKeys, DrainEvents, SetSpares

if TYPE_CHECKING:
    from worker.engine.engine_loop import EngineLoop

log = logging.getLogger("worker.actor")  # the actor's log, as its other lines

# how long a starting worker waits for the index to hold what its disk tier holds before it
# takes requests anyway (Redis slow or down: the publisher keeps retrying behind it)
ANNOUNCE_WAIT_S = 5.0


class IndexLink:
    """A worker's publisher (None without an index) and the calls it makes on the engine."""

    def __init__(self, config: IndexConfig | None, worker_id: str, engine_loop: EngineLoop) -> None:
        self.worker_id = worker_id
        self._engine_loop = engine_loop
        self._spares_after = 0.0  # monotonic time before which a spares refresh is dropped
        self.publisher: WorkerPublisher | None = None
        if config is not None:
            self.publisher = WorkerPublisher(
                KVIndex(config),
                worker_id,
                self._cached_keys,
                address=f"pid:{os.getpid()}",
                on_spares=self._set_spares,
            )

    def start(self, load: WorkerLoad) -> None:
        """Register with ``load`` and start the publisher's thread. What the engine holds from
        its start (a disk tier's runs) is announced under this epoch right after registering,
        and this returns once the index has it (at most ``ANNOUNCE_WAIT_S``): the worker takes
        requests only after its constructor, so the routers price its disk from the first."""
        if self.publisher is not None:
            held = self._engine_loop.call(DrainEvents())
            self.publisher.submit(held, load)
            self.publisher.start()
            if held and not self.publisher.flush(ANNOUNCE_WAIT_S):
                log.warning(
                    "worker %s: what it holds from its start (%d KV events) is not in the index "
                    "after %.0f s (Redis slow or down); serving anyway, the publisher retries",
                    self.worker_id,
                    len(held),
                    ANNOUNCE_WAIT_S,
                )

    def publish(self, events: Sequence[KVEvent], load: WorkerLoad) -> None:
        """Engine thread, after a step: its KV events and the load after it."""
        if self.publisher is not None:
            self.publisher.submit(events, load)

    @property
    def epoch(self) -> int | None:
        """This worker's registration epoch (None: not registered, or no index)."""
        return self.publisher.epoch if self.publisher is not None else None

    @property
    def healthy(self) -> bool:
        return self.publisher.healthy if self.publisher is not None else False

    def _set_spares(self, spare: set) -> None:
        """From the publisher's thread: the keys another worker keeps, evicted first here
        (fleet-aware eviction), applied between steps. Classifying is O(cached blocks) on the
        engine thread, so a refresh is dropped until 20 times the last one's duration has
        passed (at most 5 % of the engine's time, whatever the pool's size)."""
        if time.monotonic() < self._spares_after:
            return
        self._spares_after = float("inf")  # one in flight at a time
        answer = self._engine_loop.post(SetSpares(frozenset(spare)))
        if answer is None:
            self._spares_after = 0.0
        else:
            answer.add_done_callback(self._spares_applied)

    def _spares_applied(self, answer: Future) -> None:
        """Engine thread: the next refresh waits SPARES_DUTY times this one's duration."""
        took = 0.0 if answer.cancelled() or answer.exception() else answer.result()
        self._spares_after = time.monotonic() + SPARES_DUTY * took

    def _cached_keys(self) -> list | TierKeys:
        """For a resync (the publisher's thread): the pool's cached keys, read between steps,
        where no step's events are submitted, so the publisher learns exactly which
        submitted events the snapshot already holds (``mark_snapshot``)."""
        mark = self.publisher.mark_snapshot if self.publisher is not None else None
        return self._engine_loop.call(CachedKeys(mark))

    def resync(self, reason: str) -> bool:
        """A router found this worker's index entries wrong (``reason``): replace them with
        the pool's cached keys. False when this worker publishes no index."""
        if self.publisher is None:
            return False
        log.warning("worker %s: resyncing its index entries: %s", self.worker_id, reason)
        self.publisher.request_resync()
        return True

    def stop(self, timeout_s: float = 2.0) -> None:
        """A last flush, then deregister (routers drop this worker at once)."""
        if self.publisher is not None:
            self.publisher.stop(timeout_s=timeout_s)
