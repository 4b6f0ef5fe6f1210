"""The worker actor's side of the Redis index, beside the publisher's thread
(``kvstore/publisher.py``): the spares the index names, applied between steps; the pool's
cached keys for a resync; a resync a router asks for.

:class:`IndexHooks` is mixed into the worker actor."""

from __future__ import annotations

import logging
import time

from kvstore.blocks.tiers import Tier
from kvstore.events import TierKeys
from kvstore.index_sync import SPARES_DUTY
from kvstore.publisher import WorkerPublisher
from worker.engine import Engine
from worker.engine.front import StreamingEngine

log = logging.getLogger("worker.actor")  # the actor's log, as its other lines


class IndexHooks:
    """Mixin of the worker actor: needs its ``front``, ``publisher`` (None: no index),
    ``worker_id`` and ``_spares_after`` (0.0 at the start)."""

    front: StreamingEngine
    publisher: WorkerPublisher | None
    worker_id: str
    _spares_after: float  # monotonic time before which a spares refresh is dropped

    def _set_spares(self, spare: set) -> None:
        """From the publisher's thread: the keys another worker keeps, evicted first here
        (fleet-aware eviction), applied between steps. Classifying is O(cached blocks) on the
        engine thread, so a refresh is dropped until 20 times the last one's duration has
        passed (at most 5 % of the engine's time, whatever the pool's size)."""
        if time.monotonic() < self._spares_after:
            return

        def apply(engine: Engine) -> None:
            t0 = time.monotonic()
            try:
                engine.kv.set_spares(spare)
            finally:
                now = time.monotonic()
                self._spares_after = now + SPARES_DUTY * (now - t0)

        self._spares_after = float("inf")  # one in flight at a time
        if not self.front.post(apply):
            self._spares_after = 0.0

    def _cached_keys(self) -> list | TierKeys:
        """For a resync: the pool's cached keys, read between steps. Under the engine lock,
        where ``_after_step`` submits, so the publisher learns exactly which submitted events
        the snapshot already holds (``mark_snapshot``) and does not replay them on it."""

        def snapshot(engine: Engine) -> list | TierKeys:
            if self.publisher is not None:
                self.publisher.mark_snapshot()
            if engine.kv.has_host_tier:
                return {
                    Tier.DEVICE: engine.kv.cached_keys(),
                    Tier.HOST: engine.kv.host_cached_keys(),
                }
            return engine.kv.cached_keys()

        return self.front.with_engine(snapshot)

    def resync_index(self, reason: str) -> bool:
        """A router found this worker's index entries wrong (``reason``): replace them with
        the pool's cached keys. False when this worker publishes no index."""
        if self.publisher is None:
            return False
        log.warning("worker %s: resyncing its index entries: %s", self.worker_id, reason)
        self.publisher.request_resync()
        return True
