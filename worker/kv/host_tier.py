"""The host-memory tier: cached blocks evicted from the device, kept for a later load back.

A :class:`~worker.kv.tier_backend.TierBackend` registered as ``"host"``. Pure bookkeeping (no
tensors): host block ids, their keys, parents, tokens and tenants, an LRU order and per-tenant
quotas. The KV manager calls :meth:`HostTier.store` when the device pool evicts a cached block
(the model runner then copies device -> host) and :meth:`checkout` when a prompt's prefix
continues here (the runner copies host -> device). Tiers are exclusive: a key leaves the host
tier when it is loaded back or recomputed on the device.

Prefix closure: the device's keys are closed (see ``block_pool.py``); the host tier keeps the
*union* closed — a host key's parent is on the device or in a tier. The device evicts
children before parents, so they arrive here first; evicting the oldest host block therefore
removes a key none of whose descendants is held here. (Tiers are exclusive, so a key never
arrives while an older copy of it waits here.) A tier below (``on_evict``) receives the
evicted blocks in the same order.

Hazard the caller must respect: a host block read by a pending load must not be the target of
a pending store. Checked-out blocks are *pinned* (not reusable) until :meth:`release_pinned`,
which the manager calls when it hands the step's copies to the runner. A block evicted into the
tier below is free at once: the copy out of it runs before any store into it (see
:class:`~worker.kv.types.TierTransfers`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Sequence

from kvstore.blocks.events import EventLog
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from worker.kv.tier_backend import TIER_BACKENDS, TierBackend
from worker.kv.tier_block import TierBlock
from worker.kv.types import TierStats


@TIER_BACKENDS.register
class HostTier(TierBackend):
    """``num_blocks`` host blocks; LRU over cached ones; per-tenant quota (optional)."""

    name = "host"
    tier = Tier.HOST

    def __init__(
        self, num_blocks: int, block_size: int, events: EventLog, tenant_quota: int | None = None
    ) -> None:
        if num_blocks < 0:
            raise ValueError(f"host num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tenant_quota = tenant_quota
        self.events = events  # the device pool's log: one ordered stream for every tier
        self.on_evict: Callable[[TierBlock], None] | None = None  # the tier below, if any
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack: low ids first
        self.lru: OrderedDict[BlockKey, TierBlock] = OrderedDict()  # oldest first
        self._by_tenant: dict[str | None, OrderedDict[BlockKey, None]] = {}
        self.pinned: list[int] = []  # checked out for a pending load; freed by release_pinned
        self._children: Counter[BlockKey | None] = Counter()  # parent -> its children here
        self.num_stored = 0  # blocks copied in from the device (eviction or swap-out)
        self.num_loaded = 0  # blocks loaded back into the device
        self.num_evicted = 0  # blocks dropped (or passed below) from the host tier (LRU or quota)

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, key: object) -> bool:
        return key in self.lru

    def get(self, key: BlockKey) -> TierBlock | None:
        return self.lru.get(key)

    def keys(self) -> list[BlockKey]:
        return list(self.lru)

    def has_children(self, key: BlockKey) -> bool:
        """Whether a block here continues ``key`` (then dropping ``key`` would leave a hole)."""
        return key in self._children

    def lookup(self, key: BlockKey, token_ids: tuple[int, ...]) -> TierBlock | None:
        """The host block caching ``key`` if its token ids match too (pure query)."""
        block = self.lru.get(key)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def store(
        self,
        key: BlockKey,
        parent: BlockKey | None,
        token_ids: tuple[int, ...],
        tenant: str | None,
    ) -> int | None:
        """Take a block evicted from the device; returns the host block id the caller must
        copy it into, or None (no tier, or every block pinned). Evicts the LRU block if full."""
        if key in self.lru or self.tenant_quota == 0:  # (the first: not with exclusive tiers)
            return None
        if not self.free and not self._evict_oldest():
            return None
        block = TierBlock(self.free.pop(), key, parent, token_ids, tenant)
        self.lru[key] = block
        self._children[parent] += 1
        self.num_stored += 1
        self.events.stored([key], parent, [token_ids], self.block_size, Tier.HOST)
        if self.tenant_quota is not None:
            mine = self._by_tenant.setdefault(tenant, OrderedDict())
            mine[key] = None
            while len(mine) > self.tenant_quota:
                self._evict_oldest(tenant, of_tenant=True)
        return block.block_id

    def refresh(self, keys: Sequence[BlockKey]) -> None:
        """Make ``keys`` (a chain, parents first) the most recent, so blocks stored next to
        continue it evict others first. Parents end up younger than their other children
        here, which only lets those go first: closure holds."""
        for key in keys:
            block = self.lru.get(key)
            if block is None:
                continue
            self.lru.move_to_end(key)
            if self.tenant_quota is not None:
                self._by_tenant[block.tenant].move_to_end(key)

    def checkout(self, blocks: Sequence[TierBlock]) -> None:
        """Take ``blocks`` out of the tier for a load back; their ids stay pinned until
        :meth:`release_pinned` (the load reads them at the next copy)."""
        if not blocks:
            return
        for block in blocks:
            self._forget(block)
            self.pinned.append(block.block_id)
        self.num_loaded += len(blocks)
        self.events.removed([b.key for b in blocks], Tier.HOST)

    def discard(self, keys: Sequence[BlockKey]) -> None:
        """Drop host copies of keys the device caches now (recomputed): tiers stay exclusive."""
        gone = [self.lru[k] for k in keys if k in self.lru]
        for block in gone:
            self._forget(block)
            self.free.append(block.block_id)
        if gone:
            self.events.removed([b.key for b in gone], Tier.HOST)

    def release_pinned(self) -> None:
        self.free.extend(self.pinned)
        self.pinned.clear()

    def num_unpinned(self) -> int:
        return self.num_blocks - len(self.pinned)

    def load_seconds(self, num_blocks: int) -> float:
        return 0.0  # a host -> device copy always beats recomputing

    def stats(self) -> TierStats:
        return TierStats(
            self.tier,
            self.num_blocks,
            len(self.lru),
            self.num_stored,
            self.num_loaded,
            self.num_evicted,
        )

    def clear(self) -> None:
        """Forget every block (the device pool's reset emits the one ``AllBlocksCleared``)."""
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.lru.clear()
        self._children.clear()
        self._by_tenant.clear()
        self.pinned.clear()

    def _evict_oldest(self, tenant: str | None = None, *, of_tenant: bool = False) -> bool:
        """Drop the least recently stored block (of ``tenant`` if ``of_tenant``): within one
        tenant the order is the same LRU restricted to its chains, so closure holds too."""
        if of_tenant:
            key = next(iter(self._by_tenant[tenant]))
        else:
            key = next(iter(self.lru), None)
            if key is None:
                return False
        block = self.lru[key]
        self._forget(block)
        self.num_evicted += 1
        self.free.append(block.block_id)
        self.events.removed([block.key], Tier.HOST)
        if self.on_evict is not None:
            self.on_evict(block)  # the tier below keeps it (its copy runs before reuse)
        return True

    def _forget(self, block: TierBlock) -> None:
        del self.lru[block.key]
        left = self._children[block.parent] - 1
        if left:
            self._children[block.parent] = left
        else:
            del self._children[block.parent]
        if self.tenant_quota is not None:
            mine = self._by_tenant[block.tenant]
            del mine[block.key]
            if not mine:
                del self._by_tenant[block.tenant]

    def check_invariants(self, device_keys: Container[BlockKey]) -> None:
        """Every block free, cached or pinned exactly once; never over its size; no key on
        the device too; per-tenant order and quota."""
        ids = [b.block_id for b in self.lru.values()] + self.free + self.pinned
        if sorted(ids) != list(range(self.num_blocks)):
            _fail(f"host blocks lost or duplicated: {sorted(ids)} of {self.num_blocks}")
        if len(self.lru) > self.num_blocks:
            _fail(f"host tier holds {len(self.lru)} blocks, size {self.num_blocks}")
        for key, block in self.lru.items():
            if block.key != key:
                _fail(f"host map entry {key.hex()} points at {block}")
            if len(block.token_ids) != self.block_size:
                _fail(f"host {block} lacks its {self.block_size} token ids")
            if key in device_keys:
                _fail(f"key {key.hex()} is cached in both tiers")
        children = Counter(b.parent for b in self.lru.values())
        if children != self._children:
            _fail("host children counts differ from the parents of its blocks")
        if self.tenant_quota is not None:
            expected: dict[str | None, list[BlockKey]] = {}
            for key, block in self.lru.items():
                expected.setdefault(block.tenant, []).append(key)
            got = {t: list(keys) for t, keys in self._by_tenant.items()}
            if got != expected:
                _fail("host per-tenant lists != host LRU order")
            if any(len(keys) > self.tenant_quota for keys in got.values()):
                _fail(f"a tenant keeps more than {self.tenant_quota} host blocks")


def _fail(message: str) -> None:
    raise AssertionError(message)
