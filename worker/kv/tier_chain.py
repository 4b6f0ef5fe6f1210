"""The KV manager's links to its lower tiers: the ordered list of tier backends below the
device, the copies pending between tiers, and which released device blocks are dropped
rather than stored below (pure Python; each tier's bookkeeping is its
:class:`~worker.kv.tier_backend.TierBackend`).

Store on eviction: a cached block the device pool evicts is stored into the first tier (a
device -> tier copy), a block tier i evicts into tier i+1 (a copy between them); what the last
tier evicts is dropped. Lookups walk the tiers in order: a key is loaded from the first tier
holding it. :meth:`TierChain.take_transfers` hands every pending copy to the runner, which
runs them before the step's copy-on-write copies and forward pass (stores read blocks the step
will overwrite, loads write blocks the step will read).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import replace
from functools import partial

from kvstore.blocks.events import EventLog
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from worker.kv.free_queue import KVBlock
from worker.kv.tier_backend import TIER_BACKENDS, TierBackend
from worker.kv.tier_block import TierBlock
from worker.kv.types import TierSpec, TierStats, TierTransfers


class TierChain:
    """The lower tiers of one KV manager, fastest first, and the copies pending between them."""

    def __init__(self, backends: Sequence[TierBackend], block_size: int) -> None:
        tiers = [b.tier for b in backends]
        if len(set(tiers)) != len(tiers) or Tier.DEVICE in tiers:
            raise ValueError(f"lower KV tiers must be distinct and below the device: {tiers}")
        self.backends = list(backends)
        self.block_size = block_size
        self.transfers = TierTransfers()  # copies pending until take_transfers
        self.no_offload: set[int] = set()  # released device blocks to drop, not store, on eviction
        self.hit_tokens = {b.tier: 0 for b in self.backends}  # prompt tokens adopted from each
        self.fetches = any(b.holds_bytes for b in self.backends)  # a hit reads bytes first
        # (lower tier, block id) -> the device block its KV is copied from in this batch: a
        # block evicted further down before that copy ran is copied from the device instead
        self._from_device: dict[tuple[Tier, int], int] = {}
        for i, backend in enumerate(self.backends):
            backend.on_evict = partial(self._store_below, i) if i + 1 < len(self.backends) else None

    @classmethod
    def from_specs(
        cls,
        specs: Iterable[TierSpec],
        block_size: int,
        events: EventLog,
        device_blocks: int,
        tenant_quota_blocks: int | None,
    ) -> TierChain:
        """Backends built by name from ``specs`` (a spec of 0 blocks is left out), each with
        the device's tenant quota in proportion to its size."""
        backends: list[TierBackend] = []
        for spec in specs:
            if spec.num_blocks < 0:
                raise ValueError(
                    f"{spec.name} tier: num_blocks must be >= 0, got {spec.num_blocks}"
                )
            if not spec.num_blocks:
                continue
            quota = None
            if tenant_quota_blocks is not None:
                quota = tenant_quota_blocks * spec.num_blocks // device_blocks
            backend_cls = TIER_BACKENDS.get(spec.name)
            backends.append(
                backend_cls(spec.num_blocks, block_size, events, quota, **spec.options)  # type: ignore[call-arg]
            )
        return cls(backends, block_size)

    def __bool__(self) -> bool:
        return bool(self.backends)

    def get(self, tier: Tier) -> TierBackend | None:
        """The backend of ``tier`` (None: not stacked here)."""
        for backend in self.backends:
            if backend.tier is tier:
                return backend
        return None

    def lookup(self, key: BlockKey, token_ids: tuple[int, ...]) -> Tier | None:
        """The first tier holding ``key`` with these tokens (a pure query)."""
        for backend in self.backends:
            if backend.lookup(key, token_ids) is not None:
                return backend.tier
        return None

    def held(self, key: BlockKey) -> tuple[TierBackend, TierBlock] | None:
        """The first tier holding ``key`` and its block there (tokens not compared)."""
        for backend in self.backends:
            block = backend.get(key)
            if block is not None:
                return backend, block
        return None

    def worth_loading(self, tiers: Sequence[Tier], recompute_s: Callable[[int], float]) -> int:
        """Of a prefix's lower blocks (their tiers, in order), how many to load: the longest
        leading part, cut at a change of tier, whose estimated load time is below
        ``recompute_s`` of its tokens (whole runs per tier: a read's cost is per run)."""
        n = len(tiers)
        while n:
            counts: dict[Tier, int] = {}
            for tier in tiers[:n]:
                counts[tier] = counts.get(tier, 0) + 1
            load_s = 0.0
            for tier, count in counts.items():
                backend = self.get(tier)
                assert backend is not None
                load_s += backend.load_seconds(count)
            if load_s < recompute_s(n * self.block_size):
                break
            last = tiers[n - 1]
            while n and tiers[n - 1] is last:
                n -= 1
        left: dict[Tier, int] = {}
        for tier in tiers[n:]:
            left[tier] = left.get(tier, 0) + 1
        for tier, count in left.items():
            backend = self.get(tier)
            assert backend is not None
            backend.skipped(count)
        return n

    def fetch(
        self, loads: Sequence[tuple[TierBackend, TierBlock]]
    ) -> list[tuple[TierBackend, TierBlock]]:
        """The leading part of a prefix's lower blocks whose bytes their tiers have ready
        (:meth:`TierBackend.fetch`): a block that fails its tier's check cuts the prefix
        there, and the tokens from it on are recomputed."""
        n = len(loads)
        for backend in self.backends:
            idx = [i for i, (b, _) in enumerate(loads) if b is backend]
            if not idx:
                continue
            ready = backend.fetch([loads[i][1] for i in idx])
            if ready < len(idx):
                n = min(n, idx[ready])
        return list(loads[:n])

    # ---- the device pool's side --------------------------------------------------------

    def store_evicted(self, block: KVBlock) -> None:
        """Pool eviction hook: keep the evicted block's KV in the first tier (copy pending)."""
        assert block.key is not None and block.token_ids is not None
        if block.block_id in self.no_offload:
            self.no_offload.discard(block.block_id)
            if not any(b.has_children(block.key) for b in self.backends):
                return  # nothing below continues it: dropping it leaves no hole
        first = self.backends[0]
        dst = first.store(block.key, block.parent, block.token_ids, block.tenant)
        if dst is not None:
            self._copy(Tier.DEVICE, block.block_id, first.tier, dst)

    def _store_below(self, i: int, block: TierBlock) -> None:
        """Tier ``i`` evicted ``block``: store it into tier ``i + 1`` (the copy pending)."""
        below = self.backends[i + 1]
        dst = below.store(block.key, block.parent, block.token_ids, block.tenant)
        if dst is not None:
            self._copy(self.backends[i].tier, block.block_id, below.tier, dst)

    def _copy(self, src: Tier, src_id: int, dst: Tier, dst_id: int) -> None:
        """Record a store into ``dst``; a source whose KV is itself still pending from the
        device (stored this batch) is read on the device instead."""
        dev = src_id if src is Tier.DEVICE else self._from_device.get((src, src_id))
        if dev is not None:
            self.transfers.add(Tier.DEVICE, dev, dst, dst_id)
            self._from_device[dst, dst_id] = dev
        else:
            self.transfers.add(src, src_id, dst, dst_id)
            self._from_device.pop((dst, dst_id), None)

    def keep_off(self, blocks: Iterable[KVBlock]) -> None:
        """Released device ``blocks`` (a recompute preemption): dropped, not stored, when the
        device evicts them."""
        self.no_offload.update(b.block_id for b in blocks)

    def taken(self, blocks: Iterable[KVBlock]) -> None:
        """``blocks`` are in use again: stored below as usual once evicted."""
        self.no_offload.difference_update(b.block_id for b in blocks)

    # ---- loads, drops and copies -------------------------------------------------------

    def checkout(self, loads: Sequence[tuple[TierBackend, TierBlock]]) -> None:
        """Take an adopted prefix's lower blocks out of their tiers (pinned until the copies
        ran), one ``BlockRemoved`` per tier, fastest tier first."""
        for backend in self.backends:
            mine = [block for b, block in loads if b is backend]
            if mine:
                backend.checkout(mine)
                self.hit_tokens[backend.tier] += len(mine) * self.block_size

    def load(self, loads: Sequence[tuple[TierBackend, TierBlock]], dst: Sequence[KVBlock]) -> None:
        """Copies of the checked-out ``loads`` into device blocks ``dst`` (in order)."""
        for (backend, block), dev in zip(loads, dst, strict=False):
            self.transfers.add(backend.tier, block.block_id, Tier.DEVICE, dev.block_id)

    def discard(self, keys: Sequence[BlockKey]) -> None:
        """The device caches ``keys`` now (recomputed or imported): tiers stay exclusive."""
        for backend in self.backends:
            backend.discard(keys)

    def take_transfers(self) -> TierTransfers:
        """Pending copies (see :class:`TierTransfers` for the order); blocks they read become
        reusable now."""
        transfers, self.transfers = self.transfers, TierTransfers()
        self._from_device.clear()
        # A host block may be stored into, evicted and stored into again before the copies
        # run: only its last offload counts (a batched copy with repeated targets is undefined).
        last = {host: dev for dev, host in transfers.to_host}
        if len(last) < len(transfers.to_host):
            transfers.to_host = [(dev, host) for host, dev in last.items()]
        for backend in self.backends:
            backend.release_pinned()
            backend.poll()
        return transfers

    def clear(self) -> None:
        """The device's cache was reset: every tier forgets its blocks."""
        for backend in self.backends:
            backend.clear()
        self.no_offload.clear()

    # ---- figures and checks ------------------------------------------------------------

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(
            replace(backend.stats(), hit_tokens=self.hit_tokens[backend.tier])
            for backend in self.backends
        )

    def check_invariants(self, device_keys: Container[BlockKey]) -> None:
        """Each tier's own checks, and no key held by two lower tiers."""
        seen: set[BlockKey] = set()
        for backend in self.backends:
            backend.check_invariants(device_keys)
            keys = set(backend.keys())
            if len(keys) != len(backend):
                raise AssertionError(
                    f"{backend.tier} tier lists {len(keys)} keys, holds {len(backend)}"
                )
            if seen & keys:
                raise AssertionError(f"{backend.tier} tier holds a key a faster tier holds too")
            seen |= keys
