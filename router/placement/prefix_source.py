"""Where the router learns how much of a prompt each worker holds: the KV index, or a
simulator's in-memory index built from the same KV events the workers publish."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TypeVar

from kvstore.blocks.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvstore.blocks.hashing import BlockKey
from kvstore.index import KVIndex
from kvstore.types import IndexUnavailable
from router.placement.breaker import CircuitBreaker
from router.placement.placement_types import WorkerId

T = TypeVar("T")
TierCounts = tuple[int, int]
"""(leading blocks on the device, further leading blocks in the host tier) of one worker."""


class PrefixSourceUnavailable(Exception):
    """The prefix source cannot answer now (e.g. Redis is down); the router routes by load."""


class PrefixSource(ABC):
    """Answers "how many leading blocks of these keys does each worker hold?".

    Implementations must: answer in one round trip (the router calls this once per
    request, on its hot path); return counts only for workers they know of (absent = 0);
    return ``None`` when they hold no data at all yet (so the router can say "no-index");
    raise :class:`PrefixSourceUnavailable` (or any exception: the router catches all) when
    unreachable. Callers must pass keys computed with the workers' block size and the
    request's ``HashContext``.
    """

    @abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, int] | None:
        """Leading blocks of ``keys`` held per worker."""

    def lookup_tiers(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, TierCounts] | None:
        """Per worker, leading blocks on its device and, after those, in its host tier.
        Sources that know no host tier report the device count alone."""
        return device_only(self.lookup(keys))

    def lookup_many(
        self, prompts: Sequence[tuple[Sequence[BlockKey], bool]]
    ) -> list[Mapping[WorkerId, TierCounts] | None]:
        """Per prompt ``(keys, tiers)``: :meth:`lookup_tiers` if ``tiers``, else
        :meth:`lookup` with no host counts; sources with a round trip per call answer all
        in one (the requests a router places together)."""
        return [self.lookup_tiers(k) if t else device_only(self.lookup(k)) for k, t in prompts]


def device_only(counts: Mapping[WorkerId, int] | None) -> dict[WorkerId, TierCounts] | None:
    """Device counts as tier counts with nothing in the host tier."""
    return None if counts is None else {w: (n, 0) for w, n in counts.items()}


class KVIndexSource(PrefixSource):
    """Adapter over the Redis index (live workers only). Reads go through ``breaker`` (shared
    with the router's other index reads): while it is open a lookup raises ``CircuitOpen``
    at once instead of waiting on Redis."""

    def __init__(self, index: KVIndex, *, breaker: CircuitBreaker | None = None) -> None:
        self.index = index
        self.breaker = breaker if breaker is not None else CircuitBreaker()

    def _read(self, read: Callable[[], T]) -> T:
        """``read()`` of the index through the breaker; an index that cannot answer is
        PrefixSourceUnavailable (the router then balances by load)."""
        try:
            return self.breaker.call(read, failures=(IndexUnavailable,))
        except IndexUnavailable as exc:
            raise PrefixSourceUnavailable(str(exc)) from exc

    def lookup(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, int] | None:
        return self._read(lambda: self.index.lookup(keys))

    def lookup_tiers(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, TierCounts] | None:
        return self._read(lambda: self.index.lookup_tiers(keys))

    def lookup_many(
        self, prompts: Sequence[tuple[Sequence[BlockKey], bool]]
    ) -> list[Mapping[WorkerId, TierCounts] | None]:
        """One round trip for all (one read through the breaker)."""
        answers = self._read(lambda: self.index.lookup_many(prompts))
        return [
            a if tiers else device_only(a)  # type: ignore[arg-type]
            for a, (_, tiers) in zip(answers, prompts, strict=True)
        ]


class InMemoryPrefixIndex(PrefixSource):
    """Key -> holders map maintained from KV events, for the simulator and tests.

    Fed exactly the events a real worker publishes (``KVCacheManager.drain_events``), so a
    simulation exercises event-driven index maintenance (including evictions and event
    delay), not an oracle view of the workers' caches. Lookup walks the chain and stops when
    no worker holds the next key: O(matched blocks x holders). Events of a host KV tier are
    kept in a second map: :meth:`lookup` answers for the device tier, :meth:`lookup_tiers`
    for both.
    """

    def __init__(self) -> None:
        self._device = _TierKeys()
        self._host = _TierKeys()
        self._next_seq: dict[WorkerId, int] = {}
        self.events_applied = 0  # events applied since creation
        self.gaps = 0  # event batches whose first seq skipped ahead (lost events)

    def apply(self, worker_id: WorkerId, events: Iterable[KVEvent]) -> None:
        """Apply one worker's events, in the order it emitted them."""
        for event in events:
            expected = self._next_seq.get(worker_id, event.seq)
            if event.seq != expected:
                self.gaps += 1
            self._next_seq[worker_id] = event.seq + 1
            self.events_applied += 1
            if isinstance(event, AllBlocksCleared):
                self.remove_worker(worker_id)
            elif getattr(event, "tier", "device") != "device":
                self._host.apply(worker_id, event)
            else:
                self._device.apply(worker_id, event)

    def remove_worker(self, worker_id: WorkerId) -> None:
        """Forget every key of a worker (it died, restarted, or cleared its cache)."""
        self._device.remove_worker(worker_id)
        self._host.remove_worker(worker_id)

    def num_keys(self, worker_id: WorkerId) -> int:
        return len(self._device.keys_of.get(worker_id, ()))

    def lookup(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, int] | None:
        if self.events_applied == 0:
            return None
        return leading_counts(keys, self._device.holders.get)

    def lookup_tiers(self, keys: Sequence[BlockKey]) -> Mapping[WorkerId, TierCounts] | None:
        device = self.lookup(keys)
        if device is None or not self._host.holders:
            return None if device is None else {w: (n, 0) for w, n in device.items()}
        empty: set[WorkerId] = set()
        dev, host = self._device.holders, self._host.holders

        def either(key: BlockKey) -> set[WorkerId]:
            return dev.get(key, empty) | host.get(key, empty)

        both = leading_counts(keys, either)
        return {w: (device.get(w, 0), n - device.get(w, 0)) for w, n in both.items()}


class _TierKeys:
    """Key -> workers holding it in one KV tier, and each worker's keys there."""

    def __init__(self) -> None:
        self.holders: dict[BlockKey, set[WorkerId]] = {}
        self.keys_of: dict[WorkerId, set[BlockKey]] = {}

    def apply(self, worker_id: WorkerId, event: KVEvent) -> None:
        mine = self.keys_of.setdefault(worker_id, set())
        if isinstance(event, BlockStored):
            for key in event.keys:
                self.holders.setdefault(key, set()).add(worker_id)
            mine.update(event.keys)
        elif isinstance(event, BlockRemoved):
            for key in event.keys:
                self._drop(key, worker_id)
            mine.difference_update(event.keys)
        else:  # pragma: no cover - a clear is handled by the caller
            raise TypeError(f"unknown KV event {event!r}")

    def remove_worker(self, worker_id: WorkerId) -> None:
        for key in self.keys_of.pop(worker_id, set()):
            self._drop(key, worker_id)

    def _drop(self, key: BlockKey, worker_id: WorkerId) -> None:
        holders = self.holders.get(key)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self.holders[key]


def leading_counts(
    keys: Sequence[BlockKey], holders_of: Callable[[BlockKey], Collection[WorkerId] | None]
) -> dict[WorkerId, int]:
    """Per worker, how many leading ``keys`` it holds; ``holders_of(key)``: its holders."""
    counts: dict[WorkerId, int] = {}
    active: set[WorkerId] | None = None
    matched = 0
    for key in keys:
        holders = holders_of(key)
        if not holders:
            break
        still = set(holders) if active is None else active.intersection(holders)
        if active is not None:
            for w in active - still:
                counts[w] = matched
        if not still:
            active = still
            break
        active = still
        matched += 1
    for w in active or ():
        counts[w] = matched
    return counts
