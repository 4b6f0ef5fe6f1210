"""Which workers a router may place on, and their load (owned by
:class:`~router.serving.ray_workers.RayWorkerDirectory`).

Live workers and their load come from the Redis index's heartbeats (one cached round trip
per ``live_ttl_s``). When Redis is unreachable the list falls back to the worker actors Ray
knows by name (the serving core adds its own in-flight counts), so requests are still
served (routing by load). A worker that died while serving is skipped until it shows a new
epoch (Ray restarted it) or, without an index, for ``dead_ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import ray

from kvstore.index import KVIndex
from kvstore.types import IndexUnavailable, WorkerLoad
from router.placement.breaker import CircuitBreaker, CircuitOpen

log = logging.getLogger(__name__)
WORKER_PREFIX = "worker-"


class WorkerLiveness:
    """The live workers (from the index's heartbeats, else Ray's named actors) and this
    router's marks of workers that died while serving."""

    def __init__(
        self,
        namespace: str,
        index: KVIndex | None,
        *,
        breaker: CircuitBreaker | None = None,
        live_ttl_s: float = 0.1,
        dead_ttl_s: float = 10.0,
    ) -> None:
        self.namespace = namespace
        self.index = index
        self.breaker = breaker if breaker is not None else CircuitBreaker()  # index reads
        self.live_ttl_s = live_ttl_s
        self.dead_ttl_s = dead_ttl_s
        self.index_ok = index is not None
        self._live: tuple[float, dict[str, tuple[int, WorkerLoad]]] = (0.0, {})
        self._dead: dict[str, tuple[float, int | None]] = {}  # worker -> (since, epoch)
        self._seen: dict[str, float] = {}  # worker -> when its heartbeat was last live

    async def from_index(self) -> dict[str, tuple[int, WorkerLoad]] | None:
        """Live workers -> (epoch, load) from the index, read at most once per
        ``live_ttl_s``; None without an index or while it is unreachable."""
        if self.index is None:
            return None
        now = time.monotonic()
        if now - self._live[0] < self.live_ttl_s:
            return self._live[1]
        try:
            infos = await asyncio.to_thread(
                self.breaker.call, self.index.live_workers, failures=(IndexUnavailable,)
            )
        except CircuitOpen:
            self.index_ok = False
            return None
        except IndexUnavailable as exc:
            if self.index_ok:
                log.warning("index unavailable, routing by load over Ray's worker list: %s", exc)
            self.index_ok = False
            return None
        self.index_ok = True
        live = {w: (i.epoch, i.load) for w, i in infos.items()}
        self._live = (now, live)
        self._seen.update(dict.fromkeys(live, now))
        return live

    def from_ray(self) -> dict[str, tuple[int | None, WorkerLoad]]:
        """Every worker actor Ray knows by name, with an empty load (blocking: a GCS call)."""
        names = ray.util.list_named_actors(all_namespaces=True)
        out: dict[str, tuple[int | None, WorkerLoad]] = {}
        for entry in names:
            if entry["namespace"] == self.namespace and entry["name"].startswith(WORKER_PREFIX):
                w = entry["name"]
                out[w] = (
                    None,
                    WorkerLoad(
                        running=0,  # the serving core adds its own open streams
                        waiting=0,
                        free_blocks=0,
                        total_blocks=0,
                        queued_prefill_tokens=0,
                    ),
                )
        return out

    def last_seen(self, worker_id: str) -> float | None:
        """When the worker's heartbeat was last live (``time.monotonic()``), if ever."""
        return self._seen.get(worker_id)

    async def candidates(self) -> Mapping[str, WorkerLoad]:
        """Live workers -> load, less those marked dead (see :meth:`mark_dead`)."""
        live = await self.from_index()
        entries = live if live else await asyncio.to_thread(self.from_ray)
        now = time.monotonic()
        out = {}
        for w, (epoch, load) in entries.items():
            dead = self._dead.get(w)
            if dead is not None:
                since, dead_epoch = dead
                restarted = epoch is not None and dead_epoch is not None and epoch > dead_epoch
                if not restarted and now - since < self.dead_ttl_s:
                    continue
                del self._dead[w]
            out[w] = load
        return out

    async def live_epochs(self) -> dict[str, int]:
        """Live workers and their epochs from the index (empty without one, or when it is
        unreachable: Ray's list has no epochs)."""
        live = await self.from_index()
        return {w: epoch for w, (epoch, _load) in (live or {}).items()}

    def mark_dead(self, worker_id: str) -> None:
        """Skip ``worker_id`` until it shows a new epoch or, without one, for ``dead_ttl_s``."""
        epoch = self._live[1].get(worker_id, (None,))[0]
        self._dead[worker_id] = (time.monotonic(), epoch)
        self._live = (0.0, self._live[1])  # re-read the registry on the next request
