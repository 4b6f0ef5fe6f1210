"""The read side of :class:`~worker.kv.manager.KVCacheManager`: prefix lookups, block
tables, free-block counts, cached keys and statistics. Every method here is a pure query (no
refs taken, nothing mutated); the manager's mutations live in ``manager.py``.

Prefix lookups walk a prompt's full blocks by their chained keys, device first; a prefix may
go on in the host tier, but never back to the device after a host block. A hit always
compares token ids too, so a key collision can never return wrong KV.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING

from kvstore.blocks.hashing import BlockKey, HashContext, block_keys, hash_block
from worker.kv.block_pool import BlockPool, KVBlock
from worker.kv.host_tier import HostBlock, HostTier
from worker.kv.invariants import check_host_tier, check_invariants
from worker.kv.types import KVStats, PrefixHit, SeqId

if TYPE_CHECKING:
    from worker.kv.manager import _Seq


class KVQueries:
    """Queries over the manager's state (set up by ``KVCacheManager.__init__``)."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    pool: BlockPool
    _host: HostTier | None
    _seqs: dict[SeqId, _Seq]
    _queried_tokens: int  # prompt tokens looked up by new sequences
    _hit_tokens: int  # of those, tokens found cached (device or host)
    _host_hit_tokens: int  # of those, tokens found in the host tier

    def lookup_prefix(
        self,
        token_ids: Sequence[int],
        ctx: HashContext,
        known_keys: Sequence[BlockKey] = (),
    ) -> PrefixHit:
        """Longest run of cached full blocks matching the prompt (pure query, takes no refs).

        Walks block by block and stops at the first miss; a hit also compares token ids.
        Capped so the last prompt token is always recomputed (its logits are needed).
        ``known_keys``: the chain of the leading full blocks of ``token_ids`` under ``ctx``
        if the caller has it (from :meth:`expected_prefix`); those blocks are not rehashed.
        """
        if not self.enable_prefix_caching:
            return PrefixHit.empty(ctx)
        bs = self.block_size
        ids: list[int] = []
        keys: list[BlockKey] = []
        parent: BlockKey | None = None
        n_host = 0
        for i in range((len(token_ids) - 1) // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            if i < len(known_keys):
                key = known_keys[i]
            else:
                key = hash_block(parent, toks, ctx.first_block_extra() if i == 0 else b"")
            block = None if n_host else self.pool.lookup(key, toks)
            if block is not None:
                ids.append(block.block_id)
            elif self._host is not None and self._host.lookup(key, toks) is not None:
                n_host += 1  # the prefix continues in the host tier
            else:
                break
            keys.append(key)
            parent = key
        return PrefixHit(tuple(ids), tuple(keys), len(keys) * bs, ctx, n_host * bs)

    def expected_prefix(
        self,
        token_ids: Sequence[int],
        ctx: HashContext,
        queued: Container[BlockKey],
        keys: Sequence[BlockKey] | None = None,
    ) -> tuple[int, list[BlockKey]]:
        """Leading prompt tokens a queued sequence should not have to compute: full blocks
        cached here or in ``queued`` (keys a sequence ahead of it will compute first: the
        caller's claims, see ``worker/kv/claims.py``), capped like :meth:`lookup_prefix`.
        Returns the count and the keys of every capped full block, which a caller may keep
        and pass back as ``keys`` to skip hashing (``keys`` may run past the cap, e.g.
        ``block_keys`` of the whole prompt).
        A pure query (no refs taken); an estimate for load reports, never for adoption.
        """
        bs = self.block_size
        n_blocks = (len(token_ids) - 1) // bs if token_ids else 0
        if keys is None:
            keys = block_keys(token_ids[: n_blocks * bs], bs, ctx)
        else:
            keys = keys[:n_blocks]
        if not self.enable_prefix_caching:
            return 0, list(keys)
        hit = 0
        for i, key in enumerate(keys):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            if key not in queued and self.pool.lookup(key, toks) is None:
                if self._host is None or self._host.lookup(key, toks) is None:
                    break
            hit += 1
        return hit * bs, list(keys)

    def cached_run(self, keys: Sequence[BlockKey]) -> int:
        """How many leading keys of the chain ``keys`` are cached on the device: by prefix
        closure a leading run, found by bisection in O(log len(keys)) lookups by key (no token
        comparison: an estimate for ordering, never for adoption)."""
        cached = self.pool.cached
        lo, hi = 0, len(keys)  # keys[:lo] cached; keys[hi:] not
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] in cached:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The sequence's physical block ids in logical order. The same list comes back
        until its blocks change (a new list then): callers read it, never modify it."""
        seq = self._seq(seq_id)
        table = seq.table
        if table is None:
            table = seq.table = [b.block_id for b in seq.blocks]
        return table

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_computed

    def has_seq(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free uncached blocks plus evictable cached ones."""
        return self.pool.num_free()

    def num_evictable_of(self, keys: Iterable[BlockKey]) -> int:
        """Of ``keys`` (distinct), how many are served by a cached device block no sequence
        holds: counted in :meth:`num_free_blocks`, yet pinned when the queued sequence that
        hits them starts (a pure query by key, one dict lookup each). A landed pull's
        blocks are left out: the router that advised it counts them until its request runs
        (``router/placement/pull_ledger.py``)."""
        cached = self.pool.cached
        return sum(
            1
            for key in keys
            if (b := cached.get(key)) is not None and b.ref_cnt == 0 and not b.landing
        )

    def can_fit(self, num_blocks_needed: int) -> bool:
        return num_blocks_needed <= self.pool.num_free()

    @property
    def has_host_tier(self) -> bool:
        return self._host is not None

    @property
    def host_num_blocks(self) -> int:
        """Size of the host tier in blocks (0: none, and no host-tier events)."""
        return self._host.num_blocks if self._host is not None else 0

    def cached_keys(self) -> list[BlockKey]:
        """Keys of all cached blocks (in use or evictable), e.g. to resync the block index.

        One C-level copy of the key map: under the GIL it is atomic with respect to an engine
        thread mutating the pool, so a publisher thread may call it without the engine's lock.
        """
        return list(self.pool.cached)

    def host_cached_keys(self) -> list[BlockKey]:
        """Keys the host tier holds (empty without one)."""
        return list(self._host.lru) if self._host is not None else []

    def stats(self) -> KVStats:
        pool = self.pool
        used = pool.num_used()
        q, h = self._queried_tokens, self._hit_tokens
        return KVStats(
            num_blocks=self.num_blocks,
            used_blocks=used,
            free_blocks=pool.num_free(),
            cached_blocks=len(pool.cached),
            evictable_cached_blocks=pool.num_evictable,
            usage=used / self.num_blocks,
            num_seqs=len(self._seqs),
            prefix_queried_tokens=q,
            prefix_hit_tokens=h,
            prefix_hit_rate=h / q if q else 0.0,
            tenant_quota_evictions=pool.quota_evictions,
            **self._host_stats(),
        )

    def _host_stats(self) -> dict[str, int]:
        host = self._host
        if host is None:
            return {}
        return {
            "host_blocks": host.num_blocks,
            "host_cached_blocks": len(host),
            "host_hit_tokens": self._host_hit_tokens,
            "host_stored_blocks": host.num_stored,
            "host_loaded_blocks": host.num_loaded,
            "host_evicted_blocks": host.num_evicted,
        }

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (used by the tests)."""
        check_invariants(self.pool, self._seqs, self.enable_prefix_caching)
        if self._host is not None:
            check_host_tier(self._host, self.pool)

    def _seq(self, seq_id: SeqId) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _adoptable(
        self, prefix: PrefixHit | None, ctx: HashContext | None, token_ids: Sequence[int] | None
    ) -> tuple[list[KVBlock], list[HostBlock]]:
        """Blocks of ``prefix`` still cached under their keys: device blocks, then the host
        blocks the prefix continues in (a stale tail is dropped)."""
        if prefix is None or not prefix.keys or not self.enable_prefix_caching:
            return [], []
        if ctx is not None and prefix.ctx is not None and prefix.ctx != ctx:
            raise ValueError(f"prefix was looked up with {prefix.ctx}, allocating with {ctx}")
        bs = self.block_size
        if token_ids is not None and prefix.num_tokens > len(token_ids) - 1:
            raise ValueError("prefix hit covers the last prompt token; it must be recomputed")
        blocks: list[KVBlock] = []
        loads: list[HostBlock] = []
        for i, key in enumerate(prefix.keys):
            block = None if loads else self.pool.cached.get(key)
            held = block if block is not None else self._host.lru.get(key) if self._host else None
            if held is None:
                break
            if token_ids is not None and held.token_ids != tuple(token_ids[i * bs : (i + 1) * bs]):
                raise ValueError(f"prefix hit block {i} does not match token_ids")
            if block is not None:
                blocks.append(block)
            else:
                loads.append(held)  # type: ignore[arg-type]
        return blocks, loads
