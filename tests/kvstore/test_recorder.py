"""Recorder: events -> ops on recorded keys (pure, no Redis)."""

from __future__ import annotations

import pytest

from kvstore.blocks.events import AllBlocksCleared, BlockRemoved
from kvstore.blocks.tiers import Tier
from kvstore.recorder import CLEARED, Op, Recorder, event_kind, sampled
from tests.kvstore.helpers import chain, removed, stored


def test_every_key_is_recorded_when_k_is_1() -> None:
    keys = chain(3)
    ops = Recorder(1).record([stored(keys), removed(keys[1]), AllBlocksCleared(2)])
    assert ops == [Op("S", tuple(keys)), Op("R", (keys[1],)), CLEARED]


def test_positions_follow_parents_across_events() -> None:
    keys = chain(9)
    rec = Recorder(3)
    ops = rec.record([stored(keys[:4]), stored(keys[4:], keys[3])])
    assert ops == [Op("S", (keys[2],)), Op("S", (keys[5], keys[8]))]
    assert rec.recorded(reversed(keys)) == [keys[8], keys[5], keys[2]]
    # removing an unrecorded key sends nothing; a recorded one is sent once known
    assert rec.record([removed(keys[3])]) == []
    assert rec.record([removed(keys[5])]) == [Op("R", (keys[5],))]
    # a replay of the removal (retry) still sends it: the server ignores what is gone
    assert rec.record([removed(keys[5])]) == [Op("R", (keys[5],))]


def test_replaying_a_batch_gives_the_same_ops() -> None:
    keys = chain(8)
    rec = Recorder(2)
    batch = [stored(keys[:5]), removed(keys[1]), stored(keys[5:], keys[4]), removed(keys[3])]
    first = rec.record(batch)
    assert rec.record(batch) == first
    assert first == [
        Op("S", (keys[1], keys[3])),
        Op("R", (keys[1],)),
        Op("S", (keys[5], keys[7])),
        Op("R", (keys[3],)),
    ]


def test_clear_forgets_positions() -> None:
    keys = chain(4)
    rec = Recorder(2)
    rec.record([stored(keys[:2])])
    assert rec.record([AllBlocksCleared(1), stored(keys[2:], keys[1])]) == [CLEARED]
    assert rec.recorded(keys) == []


def test_event_kind_accepts_only_kv_events() -> None:
    class LookAlike:
        kind = "removed"

    assert event_kind(BlockRemoved(0, ())) == "R"
    assert event_kind(AllBlocksCleared(0)) == "C"
    for other in ("BlockStored", LookAlike()):
        with pytest.raises(TypeError):
            event_kind(other)


def test_sampled_positions() -> None:
    keys = chain(10)
    assert sampled(keys, 1) is keys
    assert list(sampled(keys, 4)) == [keys[3], keys[7]]


def test_real_kv_manager_events_are_accepted() -> None:
    events = pytest.importorskip("kvstore.blocks.events")
    keys = chain(2)
    log = events.EventLog()
    log.stored(keys, None, [(1, 2, 3, 4)] * 2, 4)
    log.removed(keys[1:])
    log.cleared()
    ops = Recorder(1).record(log.drain())
    assert ops == [Op("S", tuple(keys)), Op("R", (keys[1],)), CLEARED]


@pytest.mark.parametrize("k", [1, 2])
def test_host_tier_events_are_recorded_per_tier(k: int) -> None:
    """Host-tier events make host ops, device events device ops (each op names its tier); the
    recorded keys of each tier follow that tier through offloads and loads, at positions
    k-1, 2k-1, ... of the chain (a host key's parent may be on the device)."""
    from worker.kv import HashContext, KVCacheManager, block_keys

    kv = KVCacheManager(4, 2, host_num_blocks=8)
    ctx = HashContext("m")
    kv.allocate_slots("a", [1, 2, 3, 4, 5, 6, 7, 8], 8, ctx=ctx)
    kv.free("a")
    kv.allocate_slots("b", [9, 10, 11, 12, 13, 14, 15, 16], 8, ctx=ctx)  # a -> host tier
    kv.free("b")
    hit = kv.lookup_prefix([1, 2, 3, 4, 5], ctx)
    assert hit.num_host_tokens == 4
    kv.allocate_slots("c", [1, 2, 3, 4, 5], 1, ctx=ctx, prefix=hit)  # loads 2 blocks back
    events = kv.drain_events()
    assert {e.tier for e in events if hasattr(e, "tier")} == {"device", "host"}
    rec = Recorder(k)
    tiers: dict[str, set[bytes]] = {"device": set(), "host": set()}  # keys after each event
    recorded: dict[str, set[bytes]] = {"device": set(), "host": set()}
    for e in events:
        stored = type(e).__name__ == "BlockStored"
        held = tiers[e.tier]
        tiers[e.tier] = held | set(e.keys) if stored else held - set(e.keys)
        for kind, keys, tier in rec.record([e]):
            assert kind in ("S", "R") and tier == e.tier
            assert kind != "S" or set(keys) <= tiers[tier]
            recorded[tier] = (
                recorded[tier] | set(keys) if kind == "S" else recorded[tier] - set(keys)
            )
    assert recorded["device"] == set(rec.recorded(kv.cached_keys()))
    assert recorded["host"] == set(rec.recorded(kv.host_cached_keys(), Tier.HOST))
    assert recorded["host"], "the workload leaves blocks in the host tier"
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 2, ctx)
    b = block_keys([9, 10, 11, 12, 13, 14, 15, 16], 2, ctx)
    sampled = set(a[k - 1 :: k]) | set(b[k - 1 :: k])
    assert recorded["device"] | recorded["host"] <= sampled
    assert not recorded["device"] & recorded["host"]
