"""Block-run bookkeeping of the KV manager, exactly: what an export pins (and for how long),
what an import takes, caches, announces or gives back, in both tiers."""

from __future__ import annotations

from kvstore.blocks.events import BlockRemoved, BlockStored
from kvstore.blocks.tiers import Tier
from worker.kv import HashContext, KVCacheManager, block_keys
from worker.kv.transfer import KVLayout, RunHeader

BS = 4
CTX = HashContext("m")
LAYOUT = KVLayout(BS, 1, 1, 1, "float32")


def cached(kv: KVCacheManager, prompt: list[int], rid: str = "r") -> None:
    """Compute ``prompt`` into the cache (every full block cached), then free it."""
    assert kv.allocate_slots(rid, prompt, len(prompt), ctx=CTX) is not None
    kv.free(rid)


def header(prompt: list[int], start: int = 0, n: int | None = None) -> RunHeader:
    keys = block_keys(prompt, BS, CTX)
    end = len(keys) if n is None else start + n
    toks = [tuple(prompt[i * BS : (i + 1) * BS]) for i in range(start, end)]
    return RunHeader(LAYOUT, CTX, start, tuple(keys[start:end]), tuple(toks))


PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks, 5 usable by a hit (last recomputed)


def test_export_pins_device_then_host_blocks_until_released() -> None:
    kv = KVCacheManager(8, BS, host_num_blocks=8)
    cached(kv, PROMPT)
    cached(kv, list(range(100, 117)), "evictor")  # 5 more blocks: the LRU ones go to host
    kv.take_transfers()
    kv.drain_events()
    keys = block_keys(PROMPT, BS, CTX)
    pin = kv.pin_export(keys, CTX)
    assert len(pin) == 5 and pin.keys == keys
    assert len(pin.device_ids) + len(pin.host_ids) == 5 and pin.host_ids  # both tiers
    assert kv.stats().used_blocks == len(pin.device_ids)  # one ref per device block
    assert pin.token_ids[0] == tuple(PROMPT[:4])
    kv.release_export(pin)
    kv.release_export(pin)  # idempotent
    assert kv.stats().used_blocks == 0 and not kv.drain_events()
    kv.check_invariants()
    # another context's keys are never exported as this one's
    assert len(kv.pin_export(keys, HashContext("m", cache_salt="b"))) == 0


def test_device_import_caches_only_on_commit_and_abort_leaves_nothing() -> None:
    kv = KVCacheManager(16, BS)
    plan = kv.plan_import(PROMPT, CTX, header(PROMPT))
    assert (plan.tier, plan.offset, len(plan)) == (Tier.DEVICE, 0, 5)
    assert kv.stats().cached_blocks == 0 and kv.stats().used_blocks == 5
    kv.abort_import(plan)
    assert kv.stats().used_blocks == 0 and kv.stats().cached_blocks == 0
    assert not kv.drain_events()
    plan = kv.plan_import(PROMPT, CTX, header(PROMPT))
    kv.commit_import(plan)
    (stored,) = kv.drain_events()
    assert isinstance(stored, BlockStored) and stored.keys == header(PROMPT).keys
    assert stored.parent is None and stored.tier == Tier.DEVICE
    assert kv.lookup_prefix(PROMPT, CTX).num_tokens == 20
    assert kv.stats().used_blocks == 0
    kv.check_invariants()


def test_import_skips_what_is_held_and_refuses_a_gap() -> None:
    kv = KVCacheManager(16, BS)
    cached(kv, PROMPT[:9])  # blocks 0-1 held
    kv.drain_events()
    plan = kv.plan_import(PROMPT, CTX, header(PROMPT))
    assert (plan.offset, len(plan), plan.parent) == (2, 3, block_keys(PROMPT, BS, CTX)[1])
    assert kv.stats().used_blocks == 2 + 3  # the held hit is pinned while the plan is open
    kv.commit_import(plan)
    assert kv.stats().used_blocks == 0
    other = KVCacheManager(16, BS)
    gap = other.plan_import(PROMPT, CTX, header(PROMPT, start=2))
    assert len(gap) == 0 and other.stats().used_blocks == 0 and not other.drain_events()


def test_host_import_stores_announces_and_an_abort_forgets() -> None:
    kv = KVCacheManager(2, BS, host_num_blocks=6)
    plan = kv.plan_import(PROMPT, CTX, header(PROMPT))  # 5 blocks, 2 on the device: host
    assert plan.tier == Tier.HOST and len(plan) == 5  # host size - 1: never evicts its own start
    events = kv.drain_events()
    assert [e.tier for e in events] == [Tier.HOST] * 5 and all(
        isinstance(e, BlockStored) for e in events
    )
    kv.abort_import(plan)
    (removed,) = kv.drain_events()
    assert (
        isinstance(removed, BlockRemoved) and removed.tier == Tier.HOST and len(removed.keys) == 5
    )
    assert kv.stats().host_cached_blocks == 0
    plan = kv.plan_import(PROMPT, CTX, header(PROMPT))
    kv.commit_import(plan)
    hit = kv.lookup_prefix(PROMPT, CTX)
    assert (hit.num_tokens, hit.num_host_tokens) == (20, 20)
    kv.check_invariants()


def test_host_import_continues_a_host_held_part_of_the_prefix() -> None:
    kv = KVCacheManager(4, BS, host_num_blocks=8)
    cached(kv, PROMPT[:13])  # blocks 0-2
    cached(kv, list(range(100, 108)), "evictor")  # 2 blocks: block 2 (the LRU) goes to host
    kv.take_transfers()
    kv.drain_events()
    local = kv.lookup_prefix(PROMPT, CTX)
    assert (local.num_tokens, local.num_host_tokens) == (12, 4)  # device 0-1, host 2
    keys = block_keys(PROMPT, BS, CTX)
    # the device cannot continue a host-held part: a device import past it is refused
    assert len(kv.plan_import(PROMPT, CTX, header(PROMPT, start=3), Tier.DEVICE)) == 0
    for start in (0, 3):  # from the start, or from where the local prefix ends
        plan = kv.plan_import(PROMPT, CTX, header(PROMPT, start=start))
        assert (plan.tier, len(plan), plan.parent) == (Tier.HOST, 2, keys[2])
        assert plan.offset == 3 - start and plan.keys == keys[3:5]
        events = kv.drain_events()  # one per block, each naming its parent
        assert [(e.keys, e.parent, e.tier) for e in events] == [
            ((keys[3],), keys[2], Tier.HOST),
            ((keys[4],), keys[3], Tier.HOST),
        ]
        kv.commit_import(plan)
        hit = kv.lookup_prefix(PROMPT, CTX)
        assert (hit.num_tokens, hit.num_host_tokens) == (20, 12)
        kv.check_invariants()
        kv.abort_import(kv.plan_import(PROMPT, CTX, header(PROMPT)))  # nothing new: no-op
        assert len(kv.plan_import(PROMPT, CTX, header(PROMPT))) == 0 and not kv.drain_events()
        kv.tiers.discard(keys[3:5])  # forget the import for the next round
        kv.drain_events()


def test_host_import_never_evicts_the_host_part_it_continues() -> None:
    kv = KVCacheManager(4, BS, host_num_blocks=4)
    cached(kv, PROMPT[:13])  # blocks 0-2
    cached(kv, list(range(100, 108)), "evictor")  # block 2 goes to host first (oldest there)
    for i in range(2):  # then two unrelated blocks, stored after it
        cached(kv, list(range(200 + 8 * i, 208 + 8 * i)), f"more{i}")
    kv.take_transfers()
    kv.drain_events()
    before = kv.lookup_prefix(PROMPT, CTX)
    assert before.num_host_tokens >= 4  # block 2 (at least) continues the prefix in host
    plan = kv.plan_import(PROMPT, CTX, header(PROMPT))
    assert plan.tier == Tier.HOST and len(plan) >= 1
    kv.commit_import(plan)
    after = kv.lookup_prefix(PROMPT, CTX)
    assert after.num_tokens == before.num_tokens + 4 * len(plan)
    kv.check_invariants()
