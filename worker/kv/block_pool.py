"""The block pool: physical KV blocks, ref counts, the free queue and the prefix-cache map.

Layering: pool -> manager -> scheduler. The pool knows blocks, never sequences; the manager
(``manager.py``) owns block tables and calls the pool. The blocks and their free queue (an
intrusive doubly linked list) are in ``free_queue.py``; which run of the queue a free cached
block joins (spares first, claimed blocks last) is decided by the pool's
:class:`~worker.kv.eviction_order.EvictionOrder` (``pool.order``), which owns the claims and
the per-tenant LRU lists.

Free queue order (front = handed out first):
- uncached free blocks (never used, partial, or caching off) go to the FRONT: reusing them
  evicts nothing;
- cached blocks whose ref count drops to 0 go to the BACK: they stay in the prefix cache,
  evictable, least-recently-used first;
- eviction is lazy: a cached free block keeps its key until its id is handed out again; only
  then is it removed from the map (and ``BlockRemoved`` emitted).

Prefix closure: every cached key's parent key is cached too (the Redis index's bisect lookup
relies on it, see :mod:`kvstore`). Three things keep it:

- LRU order. A sequence releases its blocks tail-first and every holder of a block also holds
  a block for each earlier key, so a cached block reaches the free queue no later than its
  parent's, and the front of the queue is evicted before its parent.
- Twins. When two sequences compute the same block concurrently, the second copy cannot be
  cached (a key has one serving block) but its children can: the key then has a *twin*, an
  uncached in-use block holding the same tokens. While a twin is in use, evicting the serving
  block would leave its children's keys cached without their parent (a hole; the worker's own
  prefix match would stop there too, so they would be dead cache). So evicting the serving
  block *promotes* a twin to serve the key instead (no ``BlockRemoved``: the worker still holds
  it). A twin released to ref count 0 stops being one; its children were released just before
  it (tail-first), so the serving block, if evictable, moves to the back of the queue to stay
  newer than them.
- A guard at eviction. The spare and computed runs (``eviction_order.py``) order blocks by
  class, not by age, so a parent can queue ahead of a child of the other class (a landed copy
  under a spare, a classification the index changed); each block counts its cached children,
  and one reached at the front while it has some (and no twin) is queued at the very back
  instead, behind them, and loses its spare class. O(1) per such block, and it is not reached
  again before the blocks ahead of it.

Per-tenant quota (optional, ``tenant_quota``): each tenant (a ``cache_salt``; ``None`` is the
unsalted tenant) may keep at most that many cached *evictable* blocks. A release that takes a
tenant over its quota evicts that tenant's own least recently used evictable block at once,
so one tenant's traffic cannot flush the others' prefixes (in-use blocks are not limited:
admission and preemption govern those). A tenant's LRU order is the free queue's order
restricted to its blocks, so its oldest evictable block has no cached descendant (a chain is
one tenant's: the salt is in its first key): prefix closure holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvstore.blocks.events import EventLog
from kvstore.blocks.hashing import BlockKey
from worker.kv.block_lifetimes import DEFAULT_SAMPLE_STRIDE, BlockLifetimes
from worker.kv.eviction_order import EvictionOrder
from worker.kv.free_queue import BlockPoolError, FreeBlockQueue, KVBlock


class BlockPool:
    """``num_blocks`` blocks, their ref counts, the free queue and the key -> block map."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        tenant_quota: int | None = None,
        sample_stride: int = DEFAULT_SAMPLE_STRIDE,
    ) -> None:
        """``sample_stride``: every that many-th block's residency is measured
        (:class:`~worker.kv.block_lifetimes.BlockLifetimes`; 0: none)."""
        if tenant_quota is not None and tenant_quota < 0:
            raise ValueError(f"tenant_quota must be >= 0 or None, got {tenant_quota}")
        self.block_size = block_size
        self.tenant_quota = tenant_quota
        self.quota_evictions = 0  # blocks evicted because their tenant was over its quota
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.lifetimes = BlockLifetimes(self.blocks, sample_stride)
        self.cached: dict[BlockKey, KVBlock] = {}  # key -> the one block serving it
        # key -> in-use uncached duplicates of its serving block, oldest first (a few at most)
        self.twins: dict[BlockKey, list[KVBlock]] = {}
        self.events = EventLog()
        self.num_evictable = 0  # cached blocks with ref count 0 (kept O(1) for stats)
        # the run each free cached block joins: claims, spares, per-tenant LRU lists
        self.order = EvictionOrder(self.free_queue, self.cached, tenant_quota)
        # called with each evicted cached block before its key is cleared (KV still intact
        # until the block is handed out and written): the host tier's offload hook
        self.on_evict: Callable[[KVBlock], None] | None = None

    def num_free(self) -> int:
        return len(self.free_queue)

    def take_new(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` blocks from the front of the free queue (ref count 1 each).

        A handed-out block that still holds a key is evicted now (lazy LRU eviction); all keys
        evicted by one call form one ``BlockRemoved`` event. A key with a twin in use is not
        evicted: the oldest twin serves it from now on.
        """
        if not 0 <= n <= len(self.free_queue):
            raise BlockPoolError(f"take_new({n}) with {len(self.free_queue)} free blocks")
        taken: list[KVBlock] = []
        evicted: list[BlockKey] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            while block.children and block.key not in self.twins:  # its children go first
                self.order.requeue_last(block)
                block = self.free_queue.popleft()
            if block.key is not None:
                self._uncache(block, evicted)
            block.ref_cnt = 1
            taken.append(block)
        if evicted:
            self.events.removed(evicted)
        return taken

    def _uncache(self, block: KVBlock, evicted: list[BlockKey]) -> None:
        """Evict an evictable cached block's key (taken out of the free queue by the caller);
        a key with a twin in use is served by the twin instead (nothing evicted)."""
        key = block.key
        if key is None or block.ref_cnt != 0:
            raise BlockPoolError(f"{block} is not an evictable cached block")
        self.num_evictable -= 1
        self.order.forget_evictable(block)
        twins = self.twins.get(key)
        if twins:
            self._promote(key, twins)
            if block.sample is not None:
                self.lifetimes.cleared(block.sample)
        else:
            if block.sample is not None:
                self.lifetimes.evicted(block.sample)
            if self.on_evict is not None:
                self.on_evict(block)
            del self.cached[key]
            evicted.append(key)
            above = self.cached.get(block.parent) if block.parent is not None else None
            if above is not None:
                above.children -= 1
        block.key = block.token_ids = block.tenant = block.parent = None
        block.pulled = block.landing = False
        block.children = 0

    def _evictable_again(self, block: KVBlock) -> list[BlockKey]:
        """``block`` (cached) just became the newest evictable one: over its tenant's quota,
        that tenant's least recently used evictable blocks go. Returns the evicted keys."""
        if self.tenant_quota is None:
            return []
        self.order.add_evictable(block)
        evicted: list[BlockKey] = []
        while (oldest := self.order.over_quota(block.tenant)) is not None:
            self.free_queue.remove(oldest)
            self._uncache(oldest, evicted)
            self.free_queue.appendleft(oldest)  # nothing to keep: reuse first
            self.quota_evictions += 1
        return evicted

    def _promote(self, key: BlockKey, twins: list[KVBlock]) -> None:
        """The oldest twin (in use) serves ``key`` instead of its evicted serving block."""
        twin = twins.pop(0)
        if not twins:
            del self.twins[key]
        twin.twin_of, twin.key = None, key
        served = self.cached[key]
        twin.tenant, twin.parent, twin.pulled = served.tenant, served.parent, served.pulled
        twin.landing, twin.children = served.landing, served.children
        self.cached[key] = twin

    def touch(self, blocks: Iterable[KVBlock], hit: bool = False) -> None:
        """Take one more ref on each block; a free (evictable) one leaves the queue in O(1).
        ``hit``: the blocks are a prefix hit (a use the residency samples count)."""
        for block in blocks:
            if hit and block.sample is not None:
                self.lifetimes.used(block.sample)
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.key is not None:
                    self.num_evictable -= 1
                    self.order.forget_evictable(block)
            if block.landing:  # a landed copy in use: evicted first once free again
                block.landing, block.pulled = False, True
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one ref on each block, in the given order (callers pass tail-first)."""
        evicted: list[BlockKey] = []
        claimed: list[KVBlock] = []  # tail-first: queued after the loop, children first
        for block in blocks:
            if block.ref_cnt <= 0:
                raise BlockPoolError(f"{block} released more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.twin_of is not None:
                    self._untwin(block)
                if block.sample is not None:
                    self.lifetimes.freed(block.sample)
                if block.key is None:
                    self.free_queue.appendleft(block)  # nothing to keep: reuse first
                elif self.order.claimed(block):  # a waiting request wants it: evicted last
                    claimed.append(block)
                    self.num_evictable += 1
                else:  # keep cached, evict least recently used (a peer's copy first)
                    self.order.queue_cached(block)
                    self.num_evictable += 1
                    evicted += self._evictable_again(block)
        for block in reversed(claimed):
            self.free_queue.appendleft_claimed(block)
        if evicted:
            self.events.removed(evicted)

    def _untwin(self, block: KVBlock) -> None:
        """A twin released to ref count 0 becomes a plain free block.

        Its children were released just before it (tail-first), so the serving block, if
        evictable, moves to the back of the queue: the parent stays newer than its children.
        """
        key = block.twin_of
        if key is None:  # pragma: no cover - the caller checked
            raise BlockPoolError(f"{block} is not a twin")
        twins = self.twins[key]
        twins.remove(block)  # a few twins per key at most
        if not twins:
            del self.twins[key]
        block.twin_of = block.token_ids = None
        served = self.cached[key]
        if served.ref_cnt == 0:
            self.order.requeue_newest(served)

    def lookup(self, key: BlockKey, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block for ``key`` if its token ids also match (no collision can hit)."""
        block = self.cached.get(key)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        keys: Sequence[BlockKey],
        token_ids: Sequence[tuple[int, ...]],
        parent: BlockKey | None,
        tenant: str | None = None,
    ) -> None:
        """Cache newly filled, chained blocks of ``tenant``; emit one ``BlockStored`` per
        unbroken run.

        A block whose key is already served by another block (two sequences computed the same
        prefix concurrently) stays uncached and becomes a twin of it (see the module docstring);
        the chain of keys continues through it.
        """
        blocks = list(blocks)
        for block in blocks:  # checked first: a refused call changes nothing
            if block.key is not None or block.twin_of is not None:
                raise BlockPoolError(f"{block} is already cached")
        run_keys: list[BlockKey] = []
        run_tokens: list[tuple[int, ...]] = []
        run_parent = parent
        for block, key, toks in zip(blocks, keys, token_ids, strict=True):
            if key in self.cached:
                block.twin_of, block.token_ids = key, toks
                self.twins.setdefault(key, []).append(block)
                if run_keys:
                    self.events.stored(run_keys, run_parent, run_tokens, self.block_size)
                    run_keys, run_tokens = [], []
                run_parent = key
                continue
            block.key, block.token_ids, block.tenant = key, toks, tenant
            if block.sample is not None:
                self.lifetimes.cached(block.sample)
            block.parent = run_keys[-1] if run_keys else run_parent
            above = self.cached.get(block.parent) if block.parent is not None else None
            block.pulled = above is not None and above.pulled  # evicted before its parent
            if above is not None:
                above.children += 1
            self.cached[key] = block
            run_keys.append(key)
            run_tokens.append(toks)
        if run_keys:
            self.events.stored(run_keys, run_parent, run_tokens, self.block_size)

    def num_used(self) -> int:
        return len(self.blocks) - len(self.free_queue)

    def reset_cache(self) -> bool:
        """Drop every key; refused (``False``, nothing changes) while any block is in use."""
        if self.num_used() > 0:
            return False
        if self.twins:
            raise BlockPoolError("a twin is in use although no block is")
        for block in self.cached.values():
            if block.sample is not None:
                self.lifetimes.cleared(block.sample)
            block.key = block.token_ids = block.tenant = block.parent = None
            block.pulled = block.landing = False
            block.children = 0
            self.free_queue.remove(block)  # out of its run (the claimed one, maybe)
            self.free_queue.appendleft(block)  # nothing to keep: reuse first
        self.cached.clear()
        self.order.forget_all_evictable()
        self.num_evictable = 0
        self.events.cleared()
        return True
