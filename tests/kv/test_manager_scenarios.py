"""Exact scenarios on tiny pools: block ids, eviction order, hit counts and event contents."""

from __future__ import annotations

import pytest

from router.serving.generate_spec import tenant_salt
from worker.kv import (
    AllBlocksCleared,
    BlockClaims,
    BlockRemoved,
    BlockStored,
    HashContext,
    KVAllocation,
    KVCacheManager,
    KVCapacityError,
    block_keys,
)

BS = 4
CTX = HashContext(model_id="m")


def _kv(num_blocks: int, **kw: bool) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, **kw)


def _keys(tokens: list[int], ctx: HashContext = CTX) -> list:
    return block_keys(tokens, BS, ctx)


def _prefill(kv: KVCacheManager, sid: str, tokens: list[int], ctx: HashContext = CTX):
    hit = kv.lookup_prefix(tokens, ctx)
    return kv.allocate_slots(sid, tokens, len(tokens) - hit.num_tokens, ctx=ctx, prefix=hit)


def _ref(kv: KVCacheManager, block_id: int) -> int:
    return kv.pool.blocks[block_id].ref_cnt


def _free_order(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


A = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] [108 109]


def test_prefill_without_hit() -> None:
    kv = _kv(8)
    assert kv.lookup_prefix(A, CTX).num_tokens == 0
    alloc = _prefill(kv, "a", A)
    assert alloc is not None
    assert alloc.new_block_ids == [0, 1, 2] and alloc.num_cached_tokens == 0 and alloc.copies == []
    assert kv.block_table("a") == [0, 1, 2] and kv.num_computed_tokens("a") == 10
    k = _keys(A)
    assert kv.drain_events() == [
        BlockStored(0, (k[0], k[1]), None, (tuple(A[0:4]), tuple(A[4:8])), BS)
    ]
    assert kv.drain_events() == []
    s = kv.stats()
    assert (s.used_blocks, s.free_blocks, s.cached_blocks, s.num_seqs) == (3, 5, 2, 1)
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens) == (10, 0)
    kv.check_invariants()


def test_prefill_with_hit_shares_blocks_and_counts_hit_tokens() -> None:
    kv = _kv(8)
    _prefill(kv, "a", A)
    kv.drain_events()
    b_tokens = A[:8] + [7, 7, 7, 7]
    hit = kv.lookup_prefix(b_tokens, CTX)
    assert hit.block_ids == (0, 1) and hit.num_tokens == 8 and list(hit.keys) == _keys(A)[:2]
    assert kv.blocks_needed(None, len(b_tokens), hit) == 1
    alloc = kv.allocate_slots("b", b_tokens, 4, ctx=CTX, prefix=hit)
    assert alloc is not None and alloc.new_block_ids == [3] and alloc.num_cached_tokens == 8
    assert kv.block_table("b") == [0, 1, 3] and kv.num_computed_tokens("b") == 12
    assert [_ref(kv, i) for i in range(4)] == [2, 2, 1, 1]
    kb = _keys(b_tokens)
    assert kv.drain_events() == [BlockStored(1, (kb[2],), kb[1], ((7, 7, 7, 7),), BS)]
    s = kv.stats()
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens) == (22, 8)
    assert s.prefix_hit_rate == pytest.approx(8 / 22)
    kv.check_invariants()


def test_last_prompt_token_is_always_recomputed() -> None:
    kv = _kv(8)
    prompt = A[:8]  # exactly two full blocks, both cached by "a"
    _prefill(kv, "a", prompt)
    kv.drain_events()
    hit = kv.lookup_prefix(prompt, CTX)
    assert hit.block_ids == (0,) and hit.num_tokens == 4
    alloc = kv.allocate_slots("b", prompt, 4, ctx=CTX, prefix=hit)
    assert alloc is not None and kv.block_table("b") == [0, 2]
    # Block 2 holds the same tokens as cached block 1: it stays uncached, no event.
    assert kv.drain_events() == [] and kv.stats().cached_blocks == 2
    kv.check_invariants()


def test_decode_growth_across_block_boundaries() -> None:
    kv = _kv(4)
    toks = [1, 2, 3]
    assert _prefill(kv, "a", toks).new_block_ids == [0]
    assert kv.drain_events() == []
    k = _keys(list(range(1, 9)))
    for tok, new_ids, events in [
        (4, [], [BlockStored(0, (k[0],), None, ((1, 2, 3, 4),), BS)]),
        (5, [1], []),
        (6, [], []),
        (7, [], []),
        (8, [], [BlockStored(1, (k[1],), k[0], ((5, 6, 7, 8),), BS)]),
        (9, [2], []),
    ]:
        toks.append(tok)
        alloc = kv.allocate_slots("a", toks, 1)
        assert alloc is not None and alloc.new_block_ids == new_ids and alloc.copies == []
        assert kv.drain_events() == events
        assert kv.num_computed_tokens("a") == len(toks)
    assert kv.block_table("a") == [0, 1, 2]
    kv.check_invariants()


def test_eviction_is_lazy_lru_and_tail_first() -> None:
    kv = _kv(8)
    a, c = A[:9], list(range(200, 209))
    _prefill(kv, "a", a)  # [0, 1, 2]
    _prefill(kv, "c", c)  # [3, 4, 5]
    kv.drain_events()
    kv.free("a")
    kv.free("c")
    # Partial tails to the front; cached blocks to the back, tail first, "a" before "c".
    assert _free_order(kv) == [5, 2, 6, 7, 1, 0, 4, 3]
    assert kv.stats().cached_blocks == 4  # nothing evicted yet
    assert kv.lookup_prefix(a, CTX).block_ids == (0, 1)
    d = list(range(300, 324))  # 6 full blocks
    assert _prefill(kv, "d", d).new_block_ids == [5, 2, 6, 7, 1, 0]
    ka, kd = _keys(a), _keys(d)
    assert kv.drain_events() == [
        BlockRemoved(2, (ka[1], ka[0])),
        BlockStored(3, tuple(kd), None, tuple(tuple(d[i : i + 4]) for i in range(0, 24, 4)), BS),
    ]
    assert kv.lookup_prefix(a, CTX).num_tokens == 0
    assert kv.lookup_prefix(c, CTX).block_ids == (3, 4)
    kv.check_invariants()


def test_hit_on_evictable_block_protects_it_from_eviction() -> None:
    kv = _kv(6)
    _prefill(kv, "a", A[:9])  # [0, 1, 2]
    kv.free("a")
    assert _free_order(kv) == [2, 3, 4, 5, 1, 0]
    kv.drain_events()
    b = A[:8] + [9]
    hit = kv.lookup_prefix(b, CTX)
    assert hit.block_ids == (0, 1)
    assert kv.blocks_needed(None, 9, hit) == 3  # one new block + two evictable hits
    alloc = kv.allocate_slots("b", b, 1, ctx=CTX, prefix=hit)
    assert alloc is not None and alloc.new_block_ids == [2] and alloc.num_cached_tokens == 8
    assert _free_order(kv) == [3, 4, 5] and kv.num_free_blocks() == 3
    assert _prefill(kv, "c", list(range(50, 62))).new_block_ids == [3, 4, 5]
    assert not any(isinstance(e, BlockRemoved) for e in kv.drain_events())
    assert kv.block_table("b") == [0, 1, 2] and kv.lookup_prefix(b, CTX).block_ids == (0, 1)
    assert _prefill(kv, "d", [1, 2]) is None
    kv.check_invariants()


def test_reset_prefix_cache_refused_while_blocks_in_use() -> None:
    kv = _kv(4)
    _prefill(kv, "a", A)
    kv.drain_events()
    keys = kv.cached_keys()
    assert kv.reset_prefix_cache() is False
    assert kv.cached_keys() == keys and kv.drain_events() == []
    kv.free("a")
    assert kv.reset_prefix_cache() is True
    assert kv.cached_keys() == [] and kv.drain_events() == [AllBlocksCleared(1)]
    assert kv.lookup_prefix(A, CTX).num_tokens == 0
    assert kv.stats().cached_blocks == 0 and kv.num_free_blocks() == 4
    kv.check_invariants()


def test_salts_isolate_tenants() -> None:
    kv = _kv(8)
    t1, t2 = HashContext("m", cache_salt="tenant-1"), HashContext("m", cache_salt="tenant-2")
    _prefill(kv, "a", A, t1)
    assert kv.lookup_prefix(A, t2).num_tokens == 0
    assert kv.lookup_prefix(A, HashContext("m")).num_tokens == 0
    assert kv.lookup_prefix(A, HashContext("other-model", cache_salt="tenant-1")).num_tokens == 0
    assert kv.lookup_prefix(A, HashContext("m", "lora", "tenant-1")).num_tokens == 0
    assert kv.lookup_prefix(A, t1).num_tokens == 8  # same tenant hits
    _prefill(kv, "b", A, t2)
    assert set(kv.block_table("a")).isdisjoint(kv.block_table("b"))
    assert set(_keys(A, t1)).isdisjoint(_keys(A, t2))
    assert kv.stats().cached_blocks == 4
    with pytest.raises(ValueError, match="looked up with"):
        kv.allocate_slots("c", A, 2, ctx=t2, prefix=kv.lookup_prefix(A, t1))
    kv.check_invariants()


def _snapshot(kv: KVCacheManager) -> tuple:
    pool = kv.pool
    return (
        {sid: kv.block_table(sid) for sid in kv.seqs},
        {sid: kv.num_computed_tokens(sid) for sid in kv.seqs},
        [(b.ref_cnt, b.key) for b in pool.blocks],
        _free_order(kv),
        dict(pool.cached),
        len(pool.events),
        list(kv.pending_copies),
        kv.stats(),
    )


def test_allocation_failure_leaves_state_exactly_unchanged() -> None:
    kv = _kv(5)
    _prefill(kv, "a", A[:9])  # [0, 1, 2]
    kv.fork("a", "a2")  # shares the partial block 2
    _prefill(kv, "x", [5, 6, 7])  # [3]
    kv.free("a")  # a2 keeps [0, 1, 2]; "x" keeps 3; block 4 free
    _prefill(kv, "y", [8])  # [4]
    kv.free("y")
    before = _snapshot(kv)
    # 1. a new sequence with hits on in-use blocks + too many new blocks
    b = A[:8] + list(range(40, 48))
    hit = kv.lookup_prefix(b, CTX)
    assert hit.num_tokens == 8 and kv.blocks_needed(None, 16, hit) == 2
    assert kv.allocate_slots("b", b, 8, ctx=CTX, prefix=hit) is None
    # 2. decode that needs a copy-on-write block and a new one
    kv.fork("a2", "a3")
    mid = _snapshot(kv)
    assert kv.allocate_slots("a2", A[:9] + [1, 2, 3, 4], 4) is None
    assert _snapshot(kv) == mid
    kv.free("a3")
    assert _snapshot(kv) == before
    # 3. can never fit: typed error, nothing changes
    with pytest.raises(KVCapacityError, match="pool has only 5"):
        kv.allocate_slots("z", list(range(21)), 21, ctx=CTX)
    # 4. bad token ids are rejected before anything is touched
    with pytest.raises(ValueError, match="token ids"):
        kv.allocate_slots("z", [1, 2, 3, -1], 4, ctx=CTX)
    with pytest.raises(ValueError, match="need >= 10"):
        kv.allocate_slots("a2", A[:9], 1)
    assert _snapshot(kv) == before
    kv.check_invariants()


def test_fork_and_copy_on_write() -> None:
    kv = _kv(6)
    base = [1, 2, 3, 4, 5, 6]
    _prefill(kv, "a", base)  # [0, 1]; block 1 half full
    kv.fork("a", "b")
    assert kv.block_table("b") == [0, 1] and kv.num_computed_tokens("b") == 6
    assert [_ref(kv, i) for i in (0, 1)] == [2, 2]
    kv.drain_events()
    alloc = kv.allocate_slots("a", base + [7], 1)
    assert alloc.new_block_ids == [2] and alloc.copies == [(1, 2)]
    assert kv.block_table("a") == [0, 2] and kv.block_table("b") == [0, 1]
    assert [_ref(kv, i) for i in (0, 1, 2)] == [2, 1, 1]
    assert kv.take_copies() == [(1, 2)] and kv.take_copies() == []
    alloc = kv.allocate_slots("b", base + [70], 1)  # sole owner now: writes in place
    assert alloc.new_block_ids == [] and alloc.copies == [] and kv.block_table("b") == [0, 1]
    kv.allocate_slots("a", base + [7, 8], 1)
    kv.allocate_slots("b", base + [70, 80], 1)
    ka, kb = _keys(base + [7, 8]), _keys(base + [70, 80])
    assert kv.drain_events() == [
        BlockStored(1, (ka[1],), ka[0], ((5, 6, 7, 8),), BS),
        BlockStored(2, (kb[1],), kb[0], ((5, 6, 70, 80),), BS),
    ]
    # A full shared block stays shared: the next token goes to a fresh block, no copy.
    kv.fork("a", "c")
    alloc = kv.allocate_slots("c", base + [7, 8, 9], 1)
    assert alloc.new_block_ids == [3] and alloc.copies == [] and kv.block_table("c") == [0, 2, 3]
    assert _ref(kv, 0) == 3 and _ref(kv, 2) == 2
    kv.free("a")
    kv.free("b")
    kv.free("c")
    assert kv.stats().used_blocks == 0
    kv.check_invariants()


def test_stale_prefix_adopts_only_what_is_still_cached() -> None:
    kv = _kv(3)
    _prefill(kv, "a", A[:9])  # [0, 1, 2]
    kv.free("a")  # free order [2, 1, 0]
    hit = kv.lookup_prefix(A[:9], CTX)
    assert hit.block_ids == (0, 1)
    _prefill(kv, "x", [1, 2, 3, 4, 5])  # takes 2 and 1: evicts A's second block
    kv.free("x")
    alloc = kv.allocate_slots("b", A[:9], 5, ctx=CTX, prefix=hit)
    assert alloc is not None and alloc.num_cached_tokens == 4 and kv.block_table("b")[0] == 0
    kv.check_invariants()


def test_hash_collision_never_returns_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.kv.manager as manager

    monkeypatch.setattr(manager, "hash_block", lambda parent, toks, extra=b"": b"\0" * 16)
    kv = _kv(8)
    kv.pool.cache_full_blocks(kv.pool.take_new(1), [b"\0" * 16], [(1, 1, 1, 1)], None)
    assert kv.lookup_prefix([2, 2, 2, 2, 2], CTX).num_tokens == 0
    assert kv.lookup_prefix([1, 1, 1, 1, 2], CTX).num_tokens == 4


def test_caching_disabled_never_hashes_or_hits() -> None:
    kv = _kv(4, enable_prefix_caching=False)
    _prefill(kv, "a", A)
    assert kv.drain_events() == [] and kv.cached_keys() == []
    kv.free("a")
    assert kv.lookup_prefix(A, CTX).num_tokens == 0 and _free_order(kv) == [0, 1, 2, 3]
    kv.check_invariants()


def test_user_errors() -> None:
    kv = _kv(4)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0)
    with pytest.raises(KeyError, match="unknown sequence"):
        kv.block_table("nope")
    with pytest.raises(KeyError, match="unknown sequence"):
        kv.fork("nope", "x")
    _prefill(kv, "a", [1, 2])
    with pytest.raises(ValueError, match="already exists"):
        kv.fork("a", "a")
    with pytest.raises(ValueError, match="prefix given"):
        kv.allocate_slots("a", [1, 2, 3], 1, prefix=kv.lookup_prefix([1, 2, 3], CTX))
    kv.free("nope")  # unknown: no-op
    kv.check_invariants()


def _twin_setup(kv: KVCacheManager) -> tuple[list[int], list[int]]:
    """ "a" and "b" prefill the same 2 blocks concurrently; "b" then caches a child block.

    Both are admitted before either fills a block, so "b"'s copies of blocks 0 and 1 are
    twins of "a"'s, and "b"'s third block is cached with a parent served by "a".
    """
    b_tokens = A[:8] + [7, 7, 7, 7, 7]
    assert _prefill_chunk(kv, "a", A[:8] + [1], 2) == [0]
    assert _prefill_chunk(kv, "b", b_tokens, 2) == [1]
    assert kv.allocate_slots("a", A[:8] + [1], 7).new_block_ids == [2, 3]
    assert kv.allocate_slots("b", b_tokens, 11).new_block_ids == [4, 5, 6]
    assert kv.block_table("a") == [0, 2, 3] and kv.block_table("b") == [1, 4, 5, 6]
    ka, kb = _keys(A[:8] + [1]), _keys(b_tokens)
    assert ka == kb[:2]
    assert kv.drain_events() == [
        BlockStored(0, tuple(ka), None, (tuple(A[0:4]), tuple(A[4:8])), BS),
        BlockStored(1, (kb[2],), kb[1], ((7, 7, 7, 7),), BS),
    ]
    pool = kv.pool
    assert {k: [b.block_id for b in t] for k, t in pool.twins.items()} == {ka[0]: [1], ka[1]: [4]}
    kv.check_invariants()
    return ka, kb


def _prefill_chunk(kv: KVCacheManager, sid: str, tokens: list[int], n: int) -> list[int]:
    hit = kv.lookup_prefix(tokens, CTX)
    return kv.allocate_slots(sid, tokens, n, ctx=CTX, prefix=hit).new_block_ids


def test_twin_is_promoted_when_its_key_is_evicted() -> None:
    kv = _kv(8)
    ka, kb = _twin_setup(kv)
    kv.free("a")  # a's served copies become evictable: [3, 7, 2, 0] (partial 3 first)
    assert _free_order(kv) == [3, 7, 2, 0]
    assert _prefill(kv, "x", list(range(50, 62))) == KVAllocation([3, 7, 2], 0, [])
    # Block 2 (key 1) was evicted, but b's twin 4 holds the same tokens: it now serves key 1,
    # with no BlockRemoved; key 0 (block 0) is still cached and its twin still waits.
    assert kv.pool.cached[ka[1]].block_id == 4 and kv.pool.cached[ka[0]].block_id == 0
    assert not any(isinstance(e, BlockRemoved) for e in kv.drain_events())
    assert {k: [b.block_id for b in t] for k, t in kv.pool.twins.items()} == {ka[0]: [1]}
    kv.free("x")
    assert _free_order(kv) == [0, 2, 7, 3]
    assert _prefill(kv, "y", list(range(60, 76))).new_block_ids == [0, 2, 7, 3]
    assert kv.pool.cached[ka[0]].block_id == 1 and kv.pool.twins == {}
    kx = _keys(list(range(50, 62)))
    assert kv.drain_events()[0] == BlockRemoved(3, (kx[2], kx[1], kx[0]))
    # The worker's own prefix match still reaches b's child block through the promoted twins.
    assert kv.lookup_prefix(A[:8] + [7, 7, 7, 7, 7], CTX).block_ids == (1, 4, 5)
    assert set(kb).issubset(kv.cached_keys())
    kv.check_invariants()


def test_released_twin_moves_its_served_block_behind_the_children() -> None:
    kv = _kv(8)
    ka, kb = _twin_setup(kv)
    kv.free("a")
    assert _free_order(kv) == [3, 7, 2, 0]
    kv.free("b")  # 6 partial to the front; 5 (child) back; twins 4, 1 free: 2 then 0 move back
    assert _free_order(kv) == [1, 4, 6, 3, 7, 5, 2, 0]
    assert kv.pool.twins == {} and kv.pool.blocks[4].token_ids is None
    # Evicting in that order drops the child (kb[2]) before its parents: no hole.
    x = list(range(300, 325))  # 7 blocks, the last one partial
    assert _prefill(kv, "x", x).new_block_ids == [1, 4, 6, 3, 7, 5, 2]
    assert kv.drain_events() == [
        BlockRemoved(2, (kb[2], ka[1])),
        BlockStored(
            3, tuple(_keys(x)), None, tuple(tuple(x[i : i + BS]) for i in range(0, 24, BS)), BS
        ),
    ]
    assert kv.cached_keys()[0] == ka[0]
    kv.check_invariants()


def test_expected_prefix_counts_cached_then_queued_blocks_and_its_keys_skip_rehashing() -> None:
    kv = _kv(16)
    _prefill(kv, "a", A[:5])  # caches block [100..103]
    prompt = A + [1, 2, 3]  # 13 tokens: 3 full blocks count (the last token is recomputed)
    keys = _keys(prompt)[:3]
    assert kv.expected_prefix(prompt, CTX, set()) == (4, keys)  # only the cached block
    assert kv.expected_prefix(prompt, CTX, {keys[1]}) == (8, keys)  # + one queued ahead
    assert kv.expected_prefix(prompt, CTX, {keys[2]}) == (4, keys)  # a hole stops the run
    assert kv.expected_prefix(prompt, HashContext("m", None, "t"), set())[0] == 0  # salted
    assert kv.expected_prefix(prompt, CTX, set(keys), keys) == (12, keys)  # given keys
    # the same keys passed to the lookup give the same hit as hashing afresh
    assert kv.lookup_prefix(prompt, CTX, keys) == kv.lookup_prefix(prompt, CTX)
    assert _kv(16, enable_prefix_caching=False).expected_prefix(prompt, CTX, set(keys)) == (
        0,
        keys,
    )


def test_block_claims_count_queued_sequences_and_say_when_a_prefix_is_shared() -> None:
    keys = _keys(A + [1, 2, 3])[:3]
    claims = BlockClaims()
    claims.claim(keys)
    claims.claim(keys[:1])  # a sibling sharing the first block
    assert dict(claims) == {keys[0]: 2, keys[1]: 1, keys[2]: 1}
    assert claims.release_keys(keys) == (True, keys[1:])  # the sibling still claims block 0
    assert dict(claims) == {keys[0]: 1}
    assert claims.release_keys(keys[:1]) == (False, keys[:1]) and not claims


def test_tenant_quota_evicts_the_tenants_own_lru_blocks_and_keeps_prefixes() -> None:
    """Quota 2 evictable blocks per tenant: tenant a's third idle block evicts a's oldest
    (a chain's deepest block: released first), never tenant b's; in-use blocks do not count."""
    kv = KVCacheManager(16, BS, tenant_quota_blocks=2)
    a, b = HashContext("m", cache_salt="a"), HashContext("m", cache_salt="b")
    long = list(range(200, 213))  # 3 full blocks + 1 token
    _prefill(kv, "b", long, b)
    kv.free("b")
    assert kv.lookup_prefix(long, b).num_tokens == 8  # b keeps its quota: the first 2 blocks
    kv.drain_events()
    _prefill(kv, "a1", long, a)
    assert kv.stats().evictable_cached_blocks == 2  # a's 3 blocks are in use: not limited
    kv.free("a1")  # tail-first: a's third block is its oldest idle one
    removed = [e for e in kv.drain_events() if isinstance(e, BlockRemoved)]
    assert [k for e in removed for k in e.keys] == [_keys(long, a)[2]]
    assert kv.lookup_prefix(long, a).num_tokens == 8 and kv.lookup_prefix(long, b).num_tokens == 8
    _prefill(kv, "a2", list(range(300, 306)), a)  # one more full block of tenant a
    kv.free("a2")  # over quota again: a's oldest idle block is the deeper one of `long`
    assert kv.lookup_prefix(long, a).num_tokens == 4  # still a prefix: block 0 kept
    assert kv.lookup_prefix(long, b).num_tokens == 8  # b untouched
    assert kv.stats().tenant_quota_evictions == 3  # b's third block, then two of a's
    kv.check_invariants()


def test_tenant_quota_counts_all_of_a_tenants_cache_salts_as_one() -> None:
    """A tenant that sends a new cache_salt with every request (each its own salt, so its own
    keys) still has one quota: its idle blocks past the quota are its own, never the other
    tenant's, however many salts it uses."""
    kv = KVCacheManager(8, BS, tenant_quota_blocks=2)
    bob = HashContext("m", cache_salt=tenant_salt("bob", ""))
    long = list(range(200, 209))  # 2 full blocks + 1 token
    _prefill(kv, "b", long, bob)
    kv.free("b")
    for i in range(6):  # alice: 6 salts x 2 blocks, far past her quota of 2
        ctx = HashContext("m", cache_salt=tenant_salt("alice", f"salt-{i}"))
        _prefill(kv, f"a{i}", list(range(300 + 10 * i, 309 + 10 * i)), ctx)
        kv.free(f"a{i}")
    assert kv.lookup_prefix(long, bob).num_tokens == 8  # bob's prefix untouched
    assert kv.stats().evictable_cached_blocks == 4  # alice's 2 + bob's 2
    kv.check_invariants()
