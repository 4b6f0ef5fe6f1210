"""KVCacheManager: block tables, prefix caching and copy-on-write over a :class:`BlockPool`.

Every sequence owns a block table (logical block i -> physical block id) and a count of
computed tokens; the table always holds exactly ``ceil(computed / block_size)`` blocks and
nothing in it ever moves. Callers (the scheduler, the trace simulator) see ids and the small
result types of ``types.py``, never pool internals.

Typical use by a scheduler::

    hit = kv.lookup_prefix(prompt, ctx)                      # pure query, no refs
    alloc = kv.allocate_slots(rid, prompt, len(prompt) - hit.num_tokens, ctx=ctx, prefix=hit)
    if alloc is None: ...                                     # does not fit now; pool unchanged
    runner.swap(kv.take_transfers())                          # host tier: offloads, loads
    runner.copy_blocks(kv.take_copies()); runner.forward(kv.block_table(rid), ...)
    kv.allocate_slots(rid, prompt + [tok], 1)                 # each decode step
    kv.free(rid)                                              # finish / abort / preempt
    publish(kv.drain_events())                                # once per engine step

The host tier's side (offloads on eviction, the copies for the runner) is in
``host_offload.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.blocks.events import KVEvent
from kvstore.blocks.hashing import (
    BlockKey,
    HashContext,
    hash_full_blocks,
    salt_owner,
)
from worker.kv.block_pool import BlockPool, KVBlock
from worker.kv.eviction_hints import EvictionHints
from worker.kv.export_import import TransferMixin
from worker.kv.host_offload import HostOffload
from worker.kv.host_tier import HostBlock
from worker.kv.queries import KVQueries
from worker.kv.types import (
    KVAllocation,
    KVCapacityError,
    PrefixHit,
    SeqId,
)


class _Seq:
    """Per-sequence state: its blocks, computed tokens and the chain of full-block keys."""

    __slots__ = ("blocks", "num_computed", "keys", "ctx", "table")

    def __init__(
        self, ctx: HashContext, blocks: list[KVBlock], num_computed: int, keys: list[BlockKey]
    ) -> None:
        self.ctx = ctx  # model / LoRA / tenant salt folded into block 0's key
        self.blocks = blocks  # the block table, as block objects
        self.num_computed = num_computed  # tokens whose KV is (being) written
        self.keys = keys  # keys of full blocks 0..len-1 (empty when caching is off)
        # ``blocks`` as ids, built on demand and dropped whenever ``blocks`` changes: a
        # decode that stays in its last block (most steps) reuses it instead of rebuilding it
        self.table: list[int] | None = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager(KVQueries, TransferMixin, HostOffload, EvictionHints):
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots each (its queries:
    :class:`~worker.kv.queries.KVQueries`; block runs move in and out through
    :class:`~worker.kv.export_import.TransferMixin`; its host tier is
    :class:`~worker.kv.host_offload.HostOffload`'s; the claims and spares that order its
    evictions go through :class:`~worker.kv.eviction_hints.EvictionHints`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        tenant_quota_blocks: int | None = None,
        host_num_blocks: int = 0,
    ) -> None:
        """``tenant_quota_blocks``: most cached evictable blocks one tenant (``cache_salt``)
        keeps; beyond it that tenant's own LRU blocks are evicted (None: no quota).
        ``host_num_blocks``: size of the host tier (0: none); the quota applies there in the
        same proportion."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pool = BlockPool(num_blocks, block_size, tenant_quota_blocks)
        self._seqs: dict[SeqId, _Seq] = {}
        self._copies: list[tuple[int, int]] = []
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._host_hit_tokens = 0
        self._init_host(host_num_blocks, tenant_quota_blocks)

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
        loads: list[HostBlock] = []
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
        if n_new + cow + evictable > self._pool.num_free():
            return None
        # Hash before mutating anything: a bad token id raises with the pool untouched.
        # Loaded host blocks are cached on the device like newly computed ones (keys known).
        new_keys: list[BlockKey] = [b.key for b in loads]
        new_toks: list[tuple[int, ...]] = [b.token_ids for b in loads]
        n_keys = len(keys) + len(loads)
        if self.enable_prefix_caching and total // bs > n_keys:
            parent = new_keys[-1] if new_keys else keys[-1] if keys else None
            more_keys, more_toks = hash_full_blocks(token_ids, bs, n_keys, total // bs, parent, ctx)
            new_keys += more_keys
            new_toks += more_toks

        if seq is None:
            self._pool.touch(blocks)
            self._no_offload.difference_update(b.block_id for b in blocks)
            seq = self._seqs[seq_id] = _Seq(ctx, list(blocks), computed, keys)
            self._queried_tokens += len(token_ids)
            self._hit_tokens += computed
            self._host_hit_tokens += len(loads) * bs
            if loads:
                assert self._host is not None
                self._host.checkout(loads)  # pinned: take_new's offloads cannot reuse them
        fresh = self._pool.take_new(n_new + cow) if n_new + cow else []
        self._no_offload.difference_update(b.block_id for b in fresh)
        for host_block, dev in zip(loads, fresh, strict=False):
            self._transfers.to_device.append((host_block.block_id, dev.block_id))
        copies: list[tuple[int, int]] = []
        if fresh:
            seq.table = None  # the block table changes below
        if cow:
            src, dst = seq.blocks[-1], fresh[0]
            seq.blocks[-1] = dst
            self._pool.release([src])
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
            self._pool.cache_full_blocks(stored, new_keys, new_toks, parent, owner)
            seq.keys.extend(new_keys)
            if self._host is not None:
                self._host.discard(new_keys)  # recomputed here: drop a stale host copy
        return KVAllocation(
            [b.block_id for b in fresh],
            computed if is_new else 0,
            copies,
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
        if n_new > self._pool.num_free():
            return False
        assert (
            n_new <= 0 or seq.num_computed % self.block_size == 0 or (seq.blocks[-1].ref_cnt == 1)
        ), "draft slots in a shared block"
        if n_new > 0:
            fresh = self._pool.take_new(n_new)
            self._no_offload.difference_update(b.block_id for b in fresh)
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
            self._pool.release(reversed(spare))
        seq.num_computed = num_computed
        n_keys = len(seq.keys)
        if self.enable_prefix_caching and num_computed // bs > n_keys:
            parent = seq.keys[-1] if seq.keys else None
            keys, toks = hash_full_blocks(
                token_ids, bs, n_keys, num_computed // bs, parent, seq.ctx
            )
            stored = seq.blocks[n_keys : n_keys + len(keys)]
            self._pool.cache_full_blocks(stored, keys, toks, parent, salt_owner(seq.ctx.cache_salt))
            seq.keys.extend(keys)
            if self._host is not None:
                self._host.discard(keys)

    def fork(self, parent_seq_id: SeqId, child_seq_id: SeqId) -> None:
        """Make ``child_seq_id`` share every block of the parent (ref counts up, no copy)."""
        parent = self._seq(parent_seq_id)
        if child_seq_id in self._seqs:
            raise ValueError(f"fork: sequence {child_seq_id!r} already exists")
        self._pool.touch(parent.blocks)
        self._seqs[child_seq_id] = _Seq(
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
            if not offload and self._host is not None:
                self._no_offload.update(b.block_id for b in seq.blocks if b.ref_cnt == 1)
            self._pool.release(reversed(seq.blocks))

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies (src, dst) to execute before the next forward pass."""
        copies, self._copies = self._copies, []
        return copies

    def drain_events(self) -> list[KVEvent]:
        """Events since the last drain, in ``seq`` order (the engine drains once per step)."""
        return self._pool.events.drain()

    def reset_prefix_cache(self) -> bool:
        """Drop the whole prefix cache; ``False`` (nothing changes) while any block is in use."""
        if not self._pool.reset_cache():
            return False
        if self._host is not None:
            self._host.clear()
        self._no_offload.clear()
        return True

    # ---- internals -----------------------------------------------------------------------

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
