"""KVCacheManager: block tables, prefix caching and copy-on-write over a :class:`BlockPool`,
with an ordered list of lower tiers below the device.

Every sequence owns a block table (logical block i -> physical block id) and a count of
computed tokens; the table always holds exactly ``ceil(computed / block_size)`` blocks and
nothing in it ever moves. Callers (the scheduler, the trace simulator) see ids and the small
result types of ``types.py``, never pool internals.

Typical use by a scheduler::

    hit = kv.lookup_prefix(prompt, ctx)                      # pure query, no refs
    alloc = kv.allocate_slots(rid, prompt, len(prompt) - hit.num_tokens, ctx=ctx, prefix=hit)
    if alloc is None: ...                                     # does not fit now; pool unchanged
    runner.swap(kv.take_transfers())                          # lower tiers: stores, loads
    runner.copy_blocks(kv.take_copies()); runner.forward(kv.block_table(rid), ...)
    kv.allocate_slots(rid, prompt + [tok], 1)                 # each decode step
    kv.free(rid)                                              # finish / abort / preempt
    publish(kv.drain_events())                                # once per engine step

What the manager holds: its pool (``kv.pool``: blocks, free queue, key map, eviction order),
its tier links (``kv.tiers``: the lower tiers, fastest first, e.g. the host tier; a cached block
the device evicts is stored into the first, and a prefix hit continues into them: adopting it
takes fresh device blocks and loads them; ``take_transfers`` hands the copies to the runner,
which runs them before the step's copy-on-write copies and forward pass) and its run transfers
(``kv.runs``: export and import of block runs between workers).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from types import MappingProxyType

from kvstore.blocks.events import KVEvent
from kvstore.blocks.hashing import (
    DEFAULT_BLOCK_SIZE,
    BlockKey,
    HashContext,
    block_keys,
    hash_block,
    hash_full_blocks,
    salt_owner,
)
from kvstore.blocks.tiers import Tier
from worker.kv.block_lifetimes import DEFAULT_SAMPLE_STRIDE
from worker.kv.block_pool import BlockPool, KVBlock
from worker.kv.claims import BlockClaims
from worker.kv.invariants import check_invariants
from worker.kv.run_transfers import RunTransfers
from worker.kv.seq_blocks import SeqBlocks
from worker.kv.tier_backend import TierBackend
from worker.kv.tier_block import TierBlock
from worker.kv.tier_chain import TierChain
from worker.kv.transfer import RunHeader
from worker.kv.types import (
    ExportPin,
    ImportPlan,
    KVAllocation,
    KVCapacityError,
    KVStats,
    PrefixHit,
    SeqId,
    TierSpec,
    TierStats,
    TierTransfers,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots each, its pool
    (``pool``), its lower tiers (``tiers``) and its block-run transfers (``runs``)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        enable_prefix_caching: bool = True,
        tenant_quota_blocks: int | None = None,
        host_num_blocks: int = 0,
        lower_tiers: Sequence[TierSpec] = (),
        recompute_seconds: Callable[[int], float] | None = None,
        block_sample_stride: int = DEFAULT_SAMPLE_STRIDE,
    ) -> None:
        """``tenant_quota_blocks``: most cached evictable blocks one tenant (``cache_salt``)
        keeps; beyond it that tenant's own LRU blocks are evicted (None: no quota); each
        lower tier applies it in the same proportion to its size.
        ``host_num_blocks``: size of the host tier (0: none), the first lower tier;
        ``lower_tiers``: further tiers below it, fastest first, backends picked by name
        (``worker.kv.tier_backend.TIER_BACKENDS``). Lower tiers exist only with prefix caching.
        ``recompute_seconds``: estimated seconds to recompute n tokens; when given, a prefix
        hit leaves to recompute the lower-tier blocks whose estimated load time is not below
        it (None: a lower-tier hit is always loaded).
        ``block_sample_stride``: every that many-th block's residency is measured (0: none;
        ``worker/kv/block_lifetimes.py``)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if host_num_blocks < 0:
            raise ValueError(f"host_num_blocks must be >= 0, got {host_num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, tenant_quota_blocks, block_sample_stride)
        specs = [TierSpec("host", host_num_blocks), *lower_tiers]
        if not enable_prefix_caching:
            specs = []
        self.tiers = TierChain.from_specs(
            specs, block_size, self.pool.events, num_blocks, tenant_quota_blocks
        )
        if self.tiers:
            self.pool.on_evict = self.tiers.store_evicted
        self.runs = RunTransfers(self)
        self.recompute_seconds = recompute_seconds
        self._seqs: dict[SeqId, SeqBlocks] = {}
        self._copies: list[tuple[int, int]] = []
        self._queried_tokens = 0  # prompt tokens looked up by new sequences
        self._hit_tokens = 0  # of those, tokens found cached (device or a lower tier)

    # ---- planning and mutations ------------------------------------------------------------

    def blocks_needed(
        self, seq_id_or_none: SeqId | None, total_tokens: int, prefix: PrefixHit | None = None
    ) -> int:
        """Free-queue blocks an ``allocate_slots`` up to ``total_tokens`` tokens would consume.

        Counts new blocks, a copy-on-write block, and evictable hit blocks it would adopt.
        """
        seq = self._seqs.get(seq_id_or_none) if seq_id_or_none is not None else None
        if seq is None:
            blocks, loads = self._adoptable(prefix, None, None)
            computed = (len(blocks) + len(loads)) * self.block_size
        else:
            blocks, computed = seq.blocks, seq.num_computed
        n_new, cow, evictable = self._count(
            blocks, computed, max(total_tokens, computed), seq is None
        )
        return n_new + cow + evictable

    def allocate_slots(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        ctx: HashContext | None = None,
        prefix: PrefixHit | None = None,
    ) -> KVAllocation | None:
        """Make room for ``num_new_tokens`` more tokens of ``seq_id``; they count as computed.

        A new sequence passes ``ctx`` and optionally the ``PrefixHit`` of ``lookup_prefix``,
        which is adopted (refs taken; hit tokens count as computed; hit blocks evicted since
        the lookup are simply not adopted). ``token_ids`` is the full token list including the
        tokens about to be computed. Blocks that become full are cached (``BlockStored``).
        Writing into a shared, partially filled last block copies it first (see
        ``take_copies``). Returns ``None`` with the pool exactly unchanged if it does not fit
        now; raises :class:`KVCapacityError` if it could never fit, ``ValueError`` on bad input.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        seq = self._seqs.get(seq_id)
        if seq is not None and prefix is None:
            # The usual decode, O(1): its last block has room and is this sequence's alone
            # (no copy-on-write), and no block fills up (nothing to hash, cache or take).
            computed = seq.num_computed
            total = computed + num_new_tokens
            if (
                total <= len(seq.blocks) * bs
                and (computed % bs == 0 or seq.blocks[-1].ref_cnt == 1 or total == computed)
                and (total // bs <= len(seq.keys) or not self.enable_prefix_caching)
                and len(token_ids) >= total
            ):
                seq.num_computed = total
                return KVAllocation([], 0)
        is_new = seq is None
        loads: list[tuple[TierBackend, TierBlock]] = []
        if seq is None:
            if ctx is None:
                ctx = prefix.ctx if prefix is not None and prefix.ctx is not None else HashContext()
            blocks, loads = self._adoptable(prefix, ctx, token_ids)
            computed = (len(blocks) + len(loads)) * bs
            keys = self._hit_keys(prefix, len(blocks))
        else:
            if prefix is not None:
                raise ValueError(f"prefix given for running sequence {seq_id!r}")
            blocks, computed, keys, ctx = seq.blocks, seq.num_computed, seq.keys, seq.ctx
        total = computed + num_new_tokens
        if len(token_ids) < total:
            raise ValueError(
                f"sequence {seq_id!r}: token_ids has {len(token_ids)} tokens, "
                f"need >= {total} ({computed} computed + {num_new_tokens} new)"
            )
        if _cdiv(total, bs) > self.num_blocks:
            raise KVCapacityError(
                f"sequence {seq_id!r} needs {_cdiv(total, bs)} blocks for {total} tokens but "
                f"the pool has only {self.num_blocks}; shorten the request or add KV blocks"
            )
        n_new, cow, evictable = self._count(blocks, computed, total, is_new)
        if n_new + cow + evictable > self.pool.num_free():
            return None
        # Hash before mutating anything: a bad token id raises with the pool untouched.
        # Loaded lower-tier blocks are cached on the device like newly computed ones.
        new_keys: list[BlockKey] = [b.key for _, b in loads]
        new_toks: list[tuple[int, ...]] = [b.token_ids for _, b in loads]
        n_keys = len(keys) + len(loads)
        if self.enable_prefix_caching and total // bs > n_keys:
            parent = new_keys[-1] if new_keys else keys[-1] if keys else None
            more_keys, more_toks = hash_full_blocks(token_ids, bs, n_keys, total // bs, parent, ctx)
            new_keys += more_keys
            new_toks += more_toks

        if seq is None:
            self.pool.touch(blocks, hit=True)
            self.tiers.taken(blocks)
            seq = self._seqs[seq_id] = SeqBlocks(ctx, list(blocks), computed, keys)
            self._queried_tokens += len(token_ids)
            self._hit_tokens += computed
            if loads:
                self.tiers.checkout(loads)  # pinned: take_new's stores cannot reuse them
        fresh = self.pool.take_new(n_new + cow) if n_new + cow else []
        self.tiers.taken(fresh)
        if loads:
            self.tiers.load(loads, fresh)
        copies: list[tuple[int, int]] = []
        if fresh:
            seq.table = None  # the block table changes below
        if cow:
            src, dst = seq.blocks[-1], fresh[0]
            seq.blocks[-1] = dst
            self.pool.release([src])
            copies.append((src.block_id, dst.block_id))
            self._copies.append(copies[0])
            seq.blocks.extend(fresh[1:])
        elif fresh:
            seq.blocks.extend(fresh)
        seq.num_computed = total
        if new_keys:
            start = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else None
            stored = seq.blocks[start : start + len(new_keys)]
            # quota by the salt's owner: a tenant's many cache_salts share its one quota
            owner = salt_owner(seq.ctx.cache_salt)
            self.pool.cache_full_blocks(stored, new_keys, new_toks, parent, owner)
            seq.keys.extend(new_keys)
            if self.tiers:
                self.tiers.discard(new_keys)  # recomputed here: drop a stale lower copy
        n_host = sum(1 for backend, _ in loads if backend.tier is Tier.HOST)
        return KVAllocation(
            [b.block_id for b in fresh],
            computed if is_new else 0,
            copies,
            n_host * bs,
            len(loads) * bs,
        )

    def append_draft_slots(self, seq_id: SeqId, num_draft_tokens: int) -> bool:
        """Room for ``num_draft_tokens`` unverified tokens (speculative drafts) after the
        sequence's computed ones; they count as computed until :meth:`settle_drafts`. Blocks
        they fill are neither hashed nor cached, so a draft never reaches the prefix cache,
        the events or a tier. Call it right after ``allocate_slots`` gave this step's real
        token (that call made the last block this sequence's own: no copy-on-write here).
        False, with the pool unchanged, if the free blocks do not suffice."""
        seq = self._seq(seq_id)
        total = seq.num_computed + num_draft_tokens
        n_new = _cdiv(total, self.block_size) - len(seq.blocks)
        if n_new > self.pool.num_free():
            return False
        assert (
            n_new <= 0 or seq.num_computed % self.block_size == 0 or (seq.blocks[-1].ref_cnt == 1)
        ), "draft slots in a shared block"
        if n_new > 0:
            fresh = self.pool.take_new(n_new)
            self.tiers.taken(fresh)
            seq.blocks.extend(fresh)
            seq.table = None
        seq.num_computed = total
        return True

    def settle_drafts(self, seq_id: SeqId, token_ids: Sequence[int], num_computed: int) -> None:
        """After verification: ``num_computed`` tokens (verified, in ``token_ids``) are
        computed, the rejected draft slots are not; whole blocks past the verified tokens go
        back to the pool (they hold no key), and blocks the verified tokens filled are cached
        like any computed block."""
        seq = self._seq(seq_id)
        if not 0 <= num_computed <= seq.num_computed or len(token_ids) < num_computed:
            raise ValueError(
                f"settle_drafts: {num_computed} verified of {seq.num_computed} slots, "
                f"{len(token_ids)} token ids"
            )
        bs = self.block_size
        keep = _cdiv(num_computed, bs)
        spare = seq.blocks[keep:]
        if spare:
            assert all(b.key is None and b.ref_cnt == 1 for b in spare), "draft block shared"
            del seq.blocks[keep:]
            seq.table = None
            self.pool.release(reversed(spare))
        seq.num_computed = num_computed
        n_keys = len(seq.keys)
        if self.enable_prefix_caching and num_computed // bs > n_keys:
            parent = seq.keys[-1] if seq.keys else None
            keys, toks = hash_full_blocks(
                token_ids, bs, n_keys, num_computed // bs, parent, seq.ctx
            )
            stored = seq.blocks[n_keys : n_keys + len(keys)]
            self.pool.cache_full_blocks(stored, keys, toks, parent, salt_owner(seq.ctx.cache_salt))
            seq.keys.extend(keys)
            if self.tiers:
                self.tiers.discard(keys)  # recomputed here: drop a stale lower copy

    def fork(self, parent_seq_id: SeqId, child_seq_id: SeqId) -> None:
        """Make ``child_seq_id`` share every block of the parent (ref counts up, no copy)."""
        parent = self._seq(parent_seq_id)
        if child_seq_id in self._seqs:
            raise ValueError(f"fork: sequence {child_seq_id!r} already exists")
        self.pool.touch(parent.blocks)
        self._seqs[child_seq_id] = SeqBlocks(
            parent.ctx, list(parent.blocks), parent.num_computed, list(parent.keys)
        )

    def free(self, seq_id: SeqId, *, offload: bool = True) -> None:
        """Release a finished, aborted or preempted sequence (no-op if unknown).

        Blocks are released tail-first, so among this sequence's cached blocks the end of the
        prompt becomes evictable before its (likely shared) start. ``offload=False``: blocks
        only this sequence holds are dropped, not offloaded, when the device evicts them (a
        preemption that chose recompute over swap).
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            if not offload and self.tiers:
                self.tiers.keep_off(b for b in seq.blocks if b.ref_cnt == 1)
            self.pool.release(reversed(seq.blocks))

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies (src, dst) to execute before the next forward pass."""
        copies, self._copies = self._copies, []
        return copies

    def take_transfers(self) -> TierTransfers:
        """Pending copies between tiers (stores first, then loads; see
        :class:`~worker.kv.types.TierTransfers`); the caller runs them before the next
        copy-on-write or forward pass. Lower-tier blocks these copies read become reusable
        now."""
        return self.tiers.take_transfers()

    def drain_events(self) -> list[KVEvent]:
        """Events since the last drain, in ``seq`` order (the engine drains once per step)."""
        return self.pool.events.drain()

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; ``False`` (nothing changes) while any block is in use."""
        if not self.pool.reset_cache():
            return False
        self.tiers.clear()
        return True

    # ---- queries ---------------------------------------------------------------------

    def lookup_prefix(
        self,
        token_ids: Sequence[int],
        ctx: HashContext,
        known_keys: Sequence[BlockKey] = (),
    ) -> PrefixHit:
        """Longest run of cached full blocks matching the prompt (pure query, takes no refs).

        Walks block by block and stops at the first miss; a hit also compares token ids.
        Capped so the last prompt token is always recomputed (its logits are needed).
        A tier that holds its own bytes (disk) reads the hit's blocks from it here and keeps
        them for the adoption that follows (:meth:`TierBackend.fetch`); otherwise no state
        changes.
        ``known_keys``: the chain of the leading full blocks of ``token_ids`` under ``ctx``
        if the caller has it (from :meth:`expected_prefix`); those blocks are not rehashed.
        """
        if not self.enable_prefix_caching:
            return PrefixHit.empty(ctx)
        bs = self.block_size
        ids: list[int] = []
        keys: list[BlockKey] = []
        parent: BlockKey | None = None
        lower: list[Tier] = []  # the tier of each block past the device hit
        tiers = self.tiers
        for i in range((len(token_ids) - 1) // bs):
            toks = tuple(token_ids[i * bs : (i + 1) * bs])
            if i < len(known_keys):
                key = known_keys[i]
            else:
                key = hash_block(parent, toks, ctx.first_block_extra() if i == 0 else b"")
            block = None if lower else self.pool.lookup(key, toks)
            if block is not None:
                ids.append(block.block_id)
            elif tiers and (tier := tiers.lookup(key, toks)) is not None:
                lower.append(tier)  # the prefix continues in a lower tier
            else:
                break
            keys.append(key)
            parent = key
        if lower and self.recompute_seconds is not None:
            n = tiers.worth_loading(lower, self.recompute_seconds)
            del keys[len(ids) + n :], lower[n:]
        if lower and tiers.fetches:
            # a tier holding its own bytes (disk) reads and checks them now, so a block that
            # fails is recomputed rather than loaded: adoption can then no longer fail
            loads = [tiers.held(key) for key in keys[len(ids) :]]
            n = len(tiers.fetch([held for held in loads if held is not None]))
            del keys[len(ids) + n :], lower[n:]
        n_host = sum(1 for tier in lower if tier is Tier.HOST)
        return PrefixHit(tuple(ids), tuple(keys), len(keys) * bs, ctx, n_host * bs, len(lower) * bs)

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
                if not self.tiers or self.tiers.lookup(key, toks) is None:
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
    def seqs(self) -> Mapping[SeqId, SeqBlocks]:
        """Live sequences and their blocks (a read-only view: change them through the
        manager's calls)."""
        return MappingProxyType(self._seqs)

    @property
    def pending_copies(self) -> tuple[tuple[int, int], ...]:
        """Copy-on-write copies not taken yet (what :meth:`take_copies` would return)."""
        return tuple(self._copies)

    @property
    def has_host_tier(self) -> bool:
        return self.tiers.get(Tier.HOST) is not None

    @property
    def host_num_blocks(self) -> int:
        """Size of the host tier in blocks (0: none, and no host-tier events)."""
        host = self.tiers.get(Tier.HOST)
        return host.num_blocks if host is not None else 0

    def cached_keys(self) -> list[BlockKey]:
        """Keys of all cached blocks (in use or evictable), e.g. to resync the block index.

        One C-level copy of the key map: under the GIL it is atomic with respect to an engine
        thread mutating the pool, so a publisher thread may call it without the engine's lock.
        """
        return list(self.pool.cached)

    def host_cached_keys(self) -> list[BlockKey]:
        """Keys the host tier holds (empty without one)."""
        return self.tier_cached_keys(Tier.HOST)

    def tier_cached_keys(self, tier: Tier) -> list[BlockKey]:
        """Keys a lower tier holds (empty if it is not stacked here)."""
        backend = self.tiers.get(tier)
        return backend.keys() if backend is not None else []

    def stats(self) -> KVStats:
        pool = self.pool
        tiers = self.tiers.stats()
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
            block_histograms=pool.lifetimes.histograms(),
            **self._host_stats(tiers),
            tiers=tiers,
        )

    @staticmethod
    def _host_stats(tiers: tuple[TierStats, ...]) -> dict[str, int]:
        for s in tiers:
            if s.tier is Tier.HOST:
                return {
                    "host_blocks": s.num_blocks,
                    "host_cached_blocks": s.cached_blocks,
                    "host_hit_tokens": s.hit_tokens,
                    "host_stored_blocks": s.stored_blocks,
                    "host_loaded_blocks": s.loaded_blocks,
                    "host_evicted_blocks": s.evicted_blocks,
                }
        return {}

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (used by the tests)."""
        check_invariants(self.pool, self._seqs, self.enable_prefix_caching)
        self.tiers.check_invariants(self.pool.cached)

    # ---- eviction hints ----------------------------------------------------------------

    @property
    def claims(self) -> BlockClaims:
        """Block key -> how many waiting sequences claim it (read only: change it through
        :meth:`claim` and :meth:`unclaim`)."""
        return self.pool.order.claims

    def claim(self, keys: Sequence[BlockKey]) -> None:
        """A waiting sequence claims the chain ``keys`` of its prompt's full blocks (from
        :meth:`expected_prefix`): cached ones are evicted only when no unclaimed block is
        left (:meth:`EvictionOrder.claim <worker.kv.eviction_order.EvictionOrder.claim>`)."""
        self.pool.order.claim(keys)

    def unclaim(self, keys: Sequence[BlockKey]) -> bool:
        """The sequence that claimed ``keys`` started or left; True if another waiting
        sequence still claims one of them."""
        return self.pool.order.unclaim(keys)

    def set_spares(self, spare: Iterable[BlockKey]) -> int:
        """Fleet-aware eviction: ``spare`` names keys another worker keeps (the index's
        answer); those blocks are evicted first (:meth:`EvictionOrder.set_spares
        <worker.kv.eviction_order.EvictionOrder.set_spares>`)."""
        return self.pool.order.set_spares(spare)

    # ---- block runs between workers (see ``run_transfers.py``) ---------------------------

    def pin_export(
        self, keys: Sequence[BlockKey], ctx: HashContext | None = None, start: int = 0
    ) -> ExportPin:
        """:meth:`RunTransfers.pin_export <worker.kv.run_transfers.RunTransfers.pin_export>`."""
        return self.runs.pin_export(keys, ctx, start)

    def release_export(self, pin: ExportPin) -> None:
        """:meth:`RunTransfers.release_export
        <worker.kv.run_transfers.RunTransfers.release_export>`."""
        self.runs.release_export(pin)

    def plan_import(
        self, token_ids: Sequence[int], ctx: HashContext, header: RunHeader, tier: str | None = None
    ) -> ImportPlan:
        """:meth:`RunTransfers.plan_import <worker.kv.run_transfers.RunTransfers.plan_import>`."""
        return self.runs.plan_import(token_ids, ctx, header, tier)

    def commit_import(self, plan: ImportPlan) -> None:
        """:meth:`RunTransfers.commit_import
        <worker.kv.run_transfers.RunTransfers.commit_import>`."""
        self.runs.commit_import(plan)

    def abort_import(self, plan: ImportPlan) -> None:
        """:meth:`RunTransfers.abort_import <worker.kv.run_transfers.RunTransfers.abort_import>`."""
        self.runs.abort_import(plan)

    # ---- internals -----------------------------------------------------------------------

    def _seq(self, seq_id: SeqId) -> SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r}") from None

    def _adoptable(
        self, prefix: PrefixHit | None, ctx: HashContext | None, token_ids: Sequence[int] | None
    ) -> tuple[list[KVBlock], list[tuple[TierBackend, TierBlock]]]:
        """Blocks of ``prefix`` still cached under their keys: device blocks, then the
        lower-tier blocks the prefix continues in (a stale tail is dropped)."""
        if prefix is None or not prefix.keys or not self.enable_prefix_caching:
            return [], []
        if ctx is not None and prefix.ctx is not None and prefix.ctx != ctx:
            raise ValueError(f"prefix was looked up with {prefix.ctx}, allocating with {ctx}")
        bs = self.block_size
        if token_ids is not None and prefix.num_tokens > len(token_ids) - 1:
            raise ValueError("prefix hit covers the last prompt token; it must be recomputed")
        blocks: list[KVBlock] = []
        loads: list[tuple[TierBackend, TierBlock]] = []
        for i, key in enumerate(prefix.keys):
            block = None if loads else self.pool.cached.get(key)
            lower = None if block is not None or not self.tiers else self.tiers.held(key)
            if block is None and lower is None:
                break
            toks = block.token_ids if block is not None else lower[1].token_ids  # type: ignore[index]
            if token_ids is not None and toks != tuple(token_ids[i * bs : (i + 1) * bs]):
                raise ValueError(f"prefix hit block {i} does not match token_ids")
            if block is not None:
                blocks.append(block)
            else:
                assert lower is not None
                loads.append(lower)
        return blocks, loads

    def _count(
        self, blocks: list[KVBlock], computed: int, total: int, is_new: bool
    ) -> tuple[int, int, int]:
        """(new blocks to append, 1 if the last block needs copy-on-write, evictable hits).

        O(1) for a running sequence; O(hit blocks) for a new one (its hits are not adopted
        yet, and those with ref count 0 will leave the free queue).
        """
        n_new = _cdiv(total, self.block_size) - len(blocks)
        cow = int(total > computed and computed % self.block_size != 0 and blocks[-1].ref_cnt > 1)
        evictable = sum(1 for b in blocks if b.ref_cnt == 0) if is_new else 0
        return n_new, cow, evictable

    @staticmethod
    def _hit_keys(prefix: PrefixHit | None, n: int) -> list[BlockKey]:
        return list(prefix.keys[:n]) if prefix is not None else []
