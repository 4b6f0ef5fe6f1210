"""KVIndex: the synchronous, thread-safe client of the global KV block index."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis

from kvstore import lookup_scripts, registry_scripts, scripts
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier, TierBlocks
from kvstore.codec import (
    check_worker_id,
    decode_apply,
    decode_live,
    decode_lookup,
    decode_lookup_tiers,
    encode_ops,
    guard,
    heartbeat_payload,
    key_blob,
)
from kvstore.config import IndexConfig, make_client
from kvstore.index_types import ApplyResult, IndexFull, WorkerInfo, WorkerLoad
from kvstore.recorder import Op, Recorder, TierKeys, sampled


class KVIndex:
    """Which worker holds which KV blocks, in Redis. Safe to share between threads.

    Every method is one round trip (one Lua script) except :meth:`purge_dead`, and raises
    :class:`IndexUnavailable` when Redis is down or slower than the configured timeouts.
    """

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        self._client = make_client(config)
        self._reg_key = config.namespace + "reg"
        names = {
            "REGISTER": registry_scripts,
            "HEARTBEAT": registry_scripts,
            "DEREGISTER": registry_scripts,
            "APPLY": scripts,
            "RESYNC": scripts,
            "HELD": scripts,
            "LIVE": registry_scripts,
            "PURGE_SCAN": registry_scripts,
            "PURGE_SLOT": registry_scripts,
        }
        self._scripts = {
            n: self._client.register_script(getattr(mod, n)) for n, mod in names.items()
        }
        self._scripts["LOOKUP"] = self._client.register_script(lookup_scripts.LOOKUP[config.lookup])
        self._scripts["SPARES"] = self._client.register_script(lookup_scripts.SPARES)
        self._scripts["LOOKUP_TIERS"] = self._client.register_script(
            lookup_scripts.LOOKUP_TIERS[config.lookup]
        )
        # Resyncs and purges may legitimately run for long (a whole pool's keys): they use a
        # second client whose timeout is generous, so a slow Redis does not fail them forever.
        slow = {"socket_timeout_s": max(5.0, 10 * config.socket_timeout_s)}
        self._slow_client = make_client(config.model_copy(update=slow))
        for n in ("RESYNC", "PURGE_SLOT"):
            self._scripts[n] = self._slow_client.register_script(getattr(names[n], n))
        self._recorders: dict[str, Recorder] = {}
        self._addresses: dict[str, str | None] = {}  # published with each heartbeat
        self._lock = threading.Lock()

    @property
    def client(self) -> redis.Redis:
        return self._client

    def close(self) -> None:
        self._client.close()
        self._slow_client.close()

    def _run(self, name: str, *args: object) -> Any:
        return guard(lambda: self._scripts[name](keys=[self._reg_key], args=list(args)))

    def recorder(self, worker_id: str) -> Recorder:
        """The recorder that samples this worker's keys (see :mod:`kvstore.recorder`)."""
        with self._lock:
            rec = self._recorders.get(worker_id)
            if rec is None:
                rec = self._recorders[worker_id] = Recorder(self.config.record_every)
            return rec

    # -- worker side -------------------------------------------------------------------

    def register(
        self, worker_id: str, address: str | None = None, load: WorkerLoad | None = None
    ) -> int:
        """Start a new registration and return its epoch (larger than any before for this id).

        Entries of the previous epoch are ignored from now on and purged later; the caller
        then publishes its whole key set with :meth:`resync` (batch_seq 1) or events from 1.
        """
        check_worker_id(worker_id)
        ttl_ms = int(self.config.heartbeat_ttl_s * 1000)
        payload = heartbeat_payload(address, load)
        try:
            epoch, _slot = self._run("REGISTER", worker_id, ttl_ms, payload)
        except redis.ResponseError as exc:
            if "KVC_FULL" in str(exc):
                raise IndexFull(f"{exc}; run purge_dead() or use fewer workers") from None
            raise
        # The recorder keeps its positions: a re-registration (Redis restarted, or this
        # worker was purged) does not empty the worker's cache, and the resync needs them.
        self._addresses[worker_id] = address
        return int(epoch)

    def heartbeat(self, worker_id: str, epoch: int, load: WorkerLoad) -> bool:
        """Refresh the worker's liveness (TTL ``heartbeat_ttl_s``) and publish its load.

        Returns False when ``epoch`` is no longer current (superseded, deregistered or purged
        after a missed heartbeat): the worker must :meth:`register` again and resync.
        """
        ttl_ms = int(self.config.heartbeat_ttl_s * 1000)
        payload = heartbeat_payload(self._addresses.get(worker_id), load)
        return bool(self._run("HEARTBEAT", worker_id, epoch, ttl_ms, payload))

    def apply_events(
        self, worker_id: str, epoch: int, batch_seq: int, events: Iterable[object]
    ) -> ApplyResult:
        """Apply a batch of KV events atomically; batches must be numbered 1, 2, 3, ...

        A gap in ``batch_seq`` or a stale epoch changes nothing and returns
        ``needs_resync=True``; a batch_seq already applied is a harmless duplicate.
        """
        return self.apply_ops(worker_id, epoch, batch_seq, self.recorder(worker_id).record(events))

    def apply_ops(self, worker_id: str, epoch: int, batch_seq: int, ops: list[Op]) -> ApplyResult:
        """:meth:`apply_events` for ops already passed through :meth:`recorder`."""
        reply = self._run("APPLY", worker_id, epoch, batch_seq, *encode_ops(ops))
        return decode_apply(reply)

    def resync(
        self,
        worker_id: str,
        epoch: int,
        batch_seq: int,
        keys: Iterable[BlockKey] | TierKeys,
    ) -> bool:
        """Replace the worker's whole key set atomically; later batches continue at batch_seq+1.

        ``keys``: its device keys, or its keys per tier (:data:`TierKeys`); a tier not given
        is emptied. Returns False when ``epoch`` is stale.
        """
        rec = self.recorder(worker_id)
        tiers: TierKeys = keys if isinstance(keys, Mapping) else {Tier.DEVICE: keys}
        args: list[object] = []
        for tier, held in tiers.items():
            args += [Tier(tier).value, key_blob(rec.recorded(held, tier))]
        reply = self._run("RESYNC", worker_id, epoch, batch_seq, *args)
        return int(reply[0]) == 0

    def spare_keys(self, worker_id: str, epoch: int) -> set[BlockKey]:
        """The recorded device keys of ``worker_id`` that another live worker keeps: one
        keeper per key (the holder with the lowest registry slot), so that every other holder
        may evict its copy first and the fleet keeps one. Empty when ``epoch`` is stale.
        O(keys the worker holds) in Redis."""
        return {BlockKey(k) for k in self._run("SPARES", worker_id, epoch)}

    def deregister(self, worker_id: str, epoch: int) -> None:
        """End a registration: its entries are ignored at once and purged later."""
        self._run("DEREGISTER", worker_id, epoch)

    # -- router side -------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """For every live worker, how many leading blocks of ``keys`` (a prompt's chained
        keys, block 0 first) it holds, in blocks; a multiple of ``record_every``.

        With ``lookup="bisect"`` (the default) the answer assumes every worker's entries are
        prefix-closed, as this engine publishes them; see :mod:`kvstore`."""
        k = self.config.record_every
        reply = self._run("LOOKUP", key_blob(sampled(keys, k)))
        return decode_lookup(reply, k)

    def lookup_tiers(self, keys: Sequence[BlockKey]) -> dict[str, TierBlocks]:
        """Like :meth:`lookup`, per live worker its leading blocks per tier (see
        :data:`~kvstore.blocks.tiers.TierBlocks`: each tier's count continues the faster
        tiers'), in one round trip."""
        k = self.config.record_every
        reply = self._run("LOOKUP_TIERS", key_blob(sampled(keys, k)))
        return decode_lookup_tiers(reply, k)

    def lookup_many(
        self, prompts: Sequence[tuple[Sequence[BlockKey], bool]]
    ) -> list[dict[str, int] | dict[str, TierBlocks]]:
        """:meth:`lookup` (or :meth:`lookup_tiers` where its flag is set) of each prompt, in
        order, in one round trip (a pipeline): a burst's requests placed together. Each
        answer is what its own call would have answered at that moment."""
        if len(prompts) == 1:
            keys, tiers = prompts[0]
            return [self.lookup_tiers(keys) if tiers else self.lookup(keys)]
        k = self.config.record_every
        scripts_ = (self._scripts["LOOKUP"], self._scripts["LOOKUP_TIERS"])

        def run() -> list:
            pipe = self._client.pipeline(transaction=False)
            for keys, tiers in prompts:
                pipe.evalsha(scripts_[tiers].sha, 1, self._reg_key, key_blob(sampled(keys, k)))
            return pipe.execute()

        try:
            replies = guard(run)
        except redis.exceptions.NoScriptError:  # Redis lost its scripts: each call reloads
            return [self.lookup_tiers(p) if t else self.lookup(p) for p, t in prompts]
        return [
            decode_lookup_tiers(r, k) if tiers else decode_lookup(r, k)
            for r, (_, tiers) in zip(replies, prompts, strict=True)
        ]

    def live_workers(self) -> dict[str, WorkerInfo]:
        """Current registrations with a live heartbeat, with their latest load."""
        return decode_live(self._run("LIVE"))

    def purge_dead(self, max_workers: int = 64, chunk: int = 2000) -> int:
        """Remove the entries of up to ``max_workers`` dead or superseded registrations and
        free their slots; returns how many were purged completely.

        Walks the registry and each dead registration's own held set, never the keyspace;
        each script call removes at most ``chunk`` entries so Redis stays responsive. Safe
        to run concurrently from several processes.
        """
        found = self._run("PURGE_SCAN", max_workers)
        done = 0
        for i in range(0, len(found), 2):
            slot, record = found[i], found[i + 1]
            while (left := int(self._run("PURGE_SLOT", slot, record, chunk))) > 0:
                pass
            done += left == 0
        return done

    def held_keys(self, worker_id: str, tier: Tier = Tier.DEVICE) -> set[BlockKey]:
        """The recorded keys the worker's current registration holds in ``tier``; for tests
        and operators."""
        return {BlockKey(k) for k in self._run("HELD", worker_id, tier.value)}

    def ping(self) -> None:
        guard(self._client.ping)

    def memory_used(self) -> int:
        """``used_memory`` of the Redis server in bytes (for benchmarks and operators)."""
        return int(guard(lambda: self._client.info("memory"))["used_memory"])
