"""Where the router has been sending each hot prefix, and how much KV that commits per worker:
the capacity check of ``prefix_affinity`` (``PrefixAffinityConfig.capacity_aware``).

Affinity keeps a prefix on the worker that holds it. Without a capacity check, the placements
of a few hot prefixes (first touches made concurrently, where load decides ties) can leave one
worker the home of more prefixes than its cache holds: each request then evicts another
prefix's tail there (LRU, tail-first), every prefix stays *mostly* held, so that worker keeps
winning every one of them and recomputes tails forever, while others sit with room to spare.

So each placement names its prefix's **home**: one worker per prefix, the latest one the
router placed it on. A prefix is named by the key of its last shared block: the longest
leading run of the prompt that some worker holds or was recently sent (the system prompt, not
the question after it); a prompt nobody has seen is named by its last full block, and when a
later sibling names a shorter, shared part of its chain, that entry is replaced by the
shorter one. A worker's **commitment** is the size, in blocks, of the prefixes homed there;
a prefix *fits* a worker when the commitment of the *other* prefixes there plus its own size
stays within the worker's KV blocks. The policy places a prefix only where it fits (when it
fits somewhere): a holder that is full of other prefixes spills this one to a worker with
room, which computes it (or pulls it, the recovery path, when pulls are on), and the prefix's
home moves, so the holder's commitment drops back and its other prefixes stay. An entry
expires ``ttl_s`` after its last placement; a first touch after ``first_ttl_s`` (at most
``ttl_s``): the whole prompt of a first touch is committed only until the index can show
its siblings what it shares (they then name the shared part), so prompts that are never
asked again do not keep their whole size committed for ``ttl_s``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvstore.blocks.hashing import BlockKey
from router.placement.placement_types import WorkerId


@dataclass(slots=True)
class _Home:
    worker_id: WorkerId
    keys: tuple[BlockKey, ...]  # the prefix's chain, block 0 first; keys[-1] names it
    until: float  # expiry
    first: bool  # a first touch: the whole prompt, its shared part not known yet


class PrefixHomes:
    """Prefix (its last key) -> home worker, size and expiry; commitment per worker."""

    def __init__(self, ttl_s: float, first_ttl_s: float | None = None) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self.first_ttl_s = ttl_s if first_ttl_s is None else min(max(first_ttl_s, 0.0), ttl_s)
        self._homes: dict[BlockKey, _Home] = {}
        self._in_chain: dict[BlockKey, BlockKey] = {}  # a key of a home's chain -> its name
        self._committed: dict[WorkerId, int] = {}  # blocks homed per worker
        self._heap: list[tuple[float, int, BlockKey]] = []
        self._order = itertools.count()

    @staticmethod
    def prefix_of(keys: Sequence[BlockKey], shared_blocks: int, cap: int) -> tuple[BlockKey, ...]:
        """The prompt's prefix: its first ``shared_blocks`` keys (what some worker holds or
        was sent), or all its cacheable keys (``cap``) when nobody has any."""
        n = min(shared_blocks, cap) if shared_blocks > 0 else min(cap, len(keys))
        return tuple(keys[:n])

    def committed(self, now: float) -> Mapping[WorkerId, int]:
        self._expire(now)
        return self._committed

    def fits(
        self, prefix: Sequence[BlockKey], worker_id: WorkerId, capacity: int, now: float
    ) -> bool:
        """Whether ``prefix`` (as :meth:`prefix_of` names it) fits ``worker_id``'s
        ``capacity`` blocks next to the other prefixes homed there (0: capacity unknown)."""
        if not prefix or capacity <= 0:
            return True
        self._expire(now)
        mine = 0
        home = self._home_of(prefix[-1])
        if home is not None and home.worker_id == worker_id:
            mine = len(home.keys)
        return self._committed.get(worker_id, 0) - mine + len(prefix) <= capacity

    def place(
        self, prefix: Sequence[BlockKey], worker_id: WorkerId, now: float, *, first: bool
    ) -> None:
        """``prefix`` was just placed on ``worker_id``: its home from now on (``first``: a
        first touch, :meth:`prefix_of` found nothing shared). The entry of the same prefix,
        or a first touch whose chain holds this prefix's name, is replaced."""
        if not prefix:
            return
        self._expire(now)
        name = prefix[-1]
        old = self._home_of(name)
        if old is not None:
            self._drop(old.keys[-1])
        keys = tuple(prefix)
        until = now + (self.first_ttl_s if first else self.ttl_s)
        self._homes[name] = _Home(worker_id, keys, until, first)
        for key in keys:
            self._in_chain.setdefault(key, name)
        self._committed[worker_id] = self._committed.get(worker_id, 0) + len(keys)
        heapq.heappush(self._heap, (until, next(self._order), name))

    def __len__(self) -> int:
        return len(self._homes)

    def _home_of(self, name: BlockKey) -> _Home | None:
        """The entry named ``name``, else the first touch whose chain holds it."""
        home = self._homes.get(name)
        if home is not None:
            return home
        longer = self._in_chain.get(name)
        home = self._homes.get(longer) if longer is not None else None
        return home if home is not None and home.first else None

    def _drop(self, name: BlockKey) -> None:
        home = self._homes.pop(name, None)
        if home is None:
            return
        for key in home.keys:
            if self._in_chain.get(key) == name:
                del self._in_chain[key]
        left = self._committed[home.worker_id] - len(home.keys)
        if left:
            self._committed[home.worker_id] = left
        else:
            del self._committed[home.worker_id]

    def _expire(self, now: float) -> None:
        while self._heap and self._heap[0][0] <= now:
            until, _, name = heapq.heappop(self._heap)
            home = self._homes.get(name)
            if home is not None and home.until == until:  # not refreshed since
                self._drop(name)
