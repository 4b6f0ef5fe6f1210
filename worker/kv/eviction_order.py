"""The eviction order of free cached blocks: which run of the pool's free queue a block
queues in, and the calls that move blocks between runs (claims, spares, landed copies).
:class:`~worker.kv.block_pool.BlockPool` holds one (``pool.order``) and asks it where each free
cached block goes; the runs themselves are :class:`~worker.kv.free_queue.FreeBlockQueue`'s.

Fleet-aware eviction: the cached blocks queue in two runs, spare copies first (a copy another
worker keeps: pulled from a peer and used since, or named by the index through
:meth:`EvictionOrder.set_spares`), then the rest, each least recently used first; so a worker
evicts what the fleet holds elsewhere before what may be the fleet's last copy. A block cached
under a spare is a spare too (it must go no later than its parent), even where no peer holds
it (a question under a shared system prompt, the tail of a prefix a peer holds in part).

Claimed blocks last: a cached block whose key a waiting request's prompt names (the claims,
``worker/kv/claims.py``, counted here through :meth:`claim` / :meth:`unclaim`)
queues behind every unclaimed one, so a request's prefix is not evicted by the requests
admitted before it while it waits (it still can be when nothing else is left). The claims
of one prompt are a chain of keys, so a claimed key's parent is claimed too: the claimed run
never holds a parent whose child queues in an earlier run. Within it, blocks claimed most
recently (the requests queued last, which run last) go first. A block whose last claim goes
moves back to its run as the newest of its kind. O(1) per claimed or released key, nothing
per step. No-op with a tenant quota (one order per tenant), as spares are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from kvstore.blocks.hashing import BlockKey
from worker.kv.claims import BlockClaims
from worker.kv.free_queue import FreeBlockQueue, KVBlock
from worker.kv.spares import spare_verdicts


class EvictionOrder:
    """Where each free cached block of a pool queues, and the state that decides it: the claims
    of waiting prompts and, with a tenant quota, each tenant's evictable blocks in LRU order.

    The pool (the owner of ``free_queue`` and ``cached``, passed in) calls :meth:`queue_cached`,
    :meth:`requeue_newest` and :meth:`requeue_last` for a free cached block, and the
    ``*_evictable`` methods as blocks enter and leave the evictable set."""

    def __init__(
        self,
        free_queue: FreeBlockQueue,
        cached: Mapping[BlockKey, KVBlock],
        tenant_quota: int | None,
    ) -> None:
        self.free_queue = free_queue  # the pool's queue: this class picks the run a block joins
        self.cached = cached  # the pool's key -> block map (read here, never changed)
        self.tenant_quota = tenant_quota
        self.claims = BlockClaims()  # keys waiting requests' prompts name (evicted last)
        # tenant -> its evictable cached blocks, least recently used first (quota only)
        self.by_tenant: dict[str | None, OrderedDict[int, KVBlock]] = {}

    def requeue_last(self, block: KVBlock) -> None:
        """Queue a free cached block (just popped) as the newest of its run (the eviction
        guard): its cached children, ahead of it, go first."""
        if self.claimed(block):  # popped from the claimed run: every other run is empty
            self.free_queue.append_claimed(block)
            return
        block.pulled = False
        self.free_queue.append(block)
        if self.tenant_quota is not None:
            self.by_tenant[block.tenant].move_to_end(block.block_id)

    def requeue_newest(self, block: KVBlock) -> None:
        """Move a queued free cached block to the back of its run (claimed or not), and to
        the back of its tenant's LRU list."""
        self.free_queue.remove(block)
        if self.claimed(block):
            self.free_queue.append_claimed(block)
        else:
            self.queue_cached(block)
        if self.tenant_quota is not None:
            self.by_tenant[block.tenant].move_to_end(block.block_id)

    def claimed(self, block: KVBlock) -> bool:
        """Whether free cached ``block`` queues in the claimed run."""
        return self.tenant_quota is None and block.key in self.claims

    def add_evictable(self, block: KVBlock) -> None:
        """``block`` (cached) just became the newest evictable block of its tenant."""
        if self.tenant_quota is not None:
            self.by_tenant.setdefault(block.tenant, OrderedDict())[block.block_id] = block

    def forget_evictable(self, block: KVBlock) -> None:
        """``block`` stopped being evictable (taken again, or evicted)."""
        if self.tenant_quota is not None:
            del self.by_tenant[block.tenant][block.block_id]

    def over_quota(self, tenant: str | None) -> KVBlock | None:
        """The least recently used evictable block of ``tenant`` while it keeps more than its
        quota (the pool evicts it), else None."""
        if self.tenant_quota is None:
            return None
        mine = self.by_tenant.get(tenant)
        if mine is None or len(mine) <= self.tenant_quota:
            return None
        return next(iter(mine.values()))

    def forget_all_evictable(self) -> None:
        """The pool dropped every key: no tenant keeps an evictable block (claims stay)."""
        self.by_tenant.clear()

    def claim(self, keys: Sequence[BlockKey]) -> None:
        """A waiting sequence claims ``keys`` (its prompt's chain of full-block keys): those
        cached and free that no one claimed before move to the front of the claimed run,
        children first. O(len(keys))."""
        first = self.claims.claim(keys)
        if self.tenant_quota is not None:
            return
        for key in first:  # each pushed to the front: the chain's tail ends up first
            block = self.cached.get(key)
            if block is not None and block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.free_queue.appendleft_claimed(block)

    def unclaim(self, keys: Sequence[BlockKey]) -> bool:
        """Drop one claim on each of ``keys``; a free cached block no one claims any more
        moves back to its run as the newest of its kind, children first. True if another
        waiting sequence still claims one of them. O(len(keys))."""
        shared, gone = self.claims.release_keys(keys)
        if self.tenant_quota is None:
            for key in reversed(gone):
                block = self.cached.get(key)
                if block is not None and block.ref_cnt == 0:
                    self.free_queue.remove(block)
                    self.queue_cached(block)
        return shared

    def queue_cached(self, block: KVBlock) -> None:
        """Queue a free cached block as the newest of its kind (with a tenant quota, whose
        per-tenant lists follow the queue's order, pulled copies queue like the rest)."""
        if block.pulled and self.tenant_quota is None:
            self.free_queue.append_pulled(block)
        else:
            self.free_queue.append(block)

    def mark_pulled(self, blocks: Iterable[KVBlock]) -> None:
        """``blocks`` (cached, in use) hold a copy pulled from a peer: once free they are
        evicted before the blocks computed here (see :class:`FreeBlockQueue`)."""
        for block in blocks:
            if block.key is not None:
                block.pulled, block.landing = True, False

    def mark_landed(self, blocks: Iterable[KVBlock]) -> None:
        """``blocks`` (cached, held only by their import) just landed from a peer for a
        request still waiting: once free they queue with the computed blocks, and become
        pulled copies (:meth:`mark_pulled`) when something takes them (:meth:`touch`)."""
        for block in blocks:
            if block.key is not None:
                block.landing, block.pulled = True, False

    def set_spares(self, spare: Iterable[BlockKey]) -> int:
        """Classify every cached block by the index's answer: ``spare`` names keys another
        worker keeps (any order; unknown keys are ignored). Those, their ancestors (a peer
        holding a block holds its prefix) and the blocks cached under them become spares; every
        other block stops being one; a landed copy stays as it is until it is used. Free blocks
        whose class changed move to the back of their run, keeping their relative order (so
        children stay ahead of parents). No-op with a tenant quota (one order per tenant).
        O(cached blocks); returns the number of free blocks moved."""
        if self.tenant_quota is not None:
            return 0
        verdict = spare_verdicts(self.cached, spare)
        moved = [
            b
            for b in self.free_queue
            if b.key is not None and verdict[b.key] != b.pulled and b.key not in self.claims
        ]
        for block in self.cached.values():
            if not block.landing:
                block.pulled = verdict[block.key]
        for block in moved:
            self.free_queue.remove(block)
            self.queue_cached(block)
        return len(moved)
