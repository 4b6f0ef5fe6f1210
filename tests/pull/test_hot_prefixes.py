"""What a warm start pulls: the shared part of the prompts a worker served (not each whole
prompt), ranked by use, merged over peers and cut to the budget. Pure Python."""

from __future__ import annotations

from kvstore.blocks.hashing import HashContext, block_keys
from worker.pull.served_prefixes import HotPrefix, ServedPrefixes, pick_warm

BS = 4
CTX = HashContext("m")


def keys(tokens: list[int], ctx: HashContext = CTX) -> tuple:
    return tuple(block_keys(tokens, BS, ctx))


SYS_A = list(range(100, 112))  # 3 blocks
SYS_B = list(range(200, 208))  # 2 blocks


def test_the_shared_system_prompt_is_hot_not_each_whole_prompt() -> None:
    served = ServedPrefixes()
    for q in range(3):
        served.note(CTX, keys(SYS_A + [q] * 4))  # 4 blocks, the last one its own
    for q in range(2):
        served.note(CTX, keys(SYS_B + [q] * 4))
    served.note(CTX, keys([9] * 8))  # once
    hot = served.hot(5)
    assert [(h.keys, h.uses) for h in hot] == [
        (keys(SYS_A), 3),
        (keys(SYS_B), 2),
        (keys([9] * 8), 1),
    ]
    assert served.hot(1) == hot[:1]
    assert served.hot(0) == []


def test_tables_are_bounded_least_recent_first() -> None:
    served = ServedPrefixes(max_prompts=2, max_keys=4)
    for i in range(5):
        served.note(CTX, keys([i] * 8))
    assert len(served._prompts) == 2 and len(served._uses) == 4
    assert [h.keys for h in served.hot(5)] == [keys([4] * 8), keys([3] * 8)]


def test_pick_warm_merges_peers_and_keeps_the_budget() -> None:
    a, b, c = (
        HotPrefix(CTX, keys(SYS_A), 3),
        HotPrefix(CTX, keys(SYS_B), 2),
        HotPrefix(CTX, keys(SYS_A + [1] * 4), 1),  # SYS_A plus one block
    )
    offers = [("w0", [a, b]), ("w1", [HotPrefix(CTX, keys(SYS_B), 4), c])]
    picked = pick_warm(offers, n=5, max_blocks=100)
    # B: 2 + 4 uses over two peers, w1 first; A: 3; A+1 brings one new block
    assert [(h.keys, peers) for h, peers in picked] == [
        (keys(SYS_B), ["w1", "w0"]),
        (keys(SYS_A), ["w0"]),
        (keys(SYS_A + [1] * 4), ["w1"]),
    ]
    assert [h.keys for h, _ in pick_warm(offers, n=5, max_blocks=5)] == [keys(SYS_B), keys(SYS_A)]
    # A does not fit in the 2 left, nor A+1 (4 new blocks): nothing is cut in half
    assert [h.keys for h, _ in pick_warm(offers, n=5, max_blocks=4)] == [keys(SYS_B)]
    assert len(pick_warm(offers, n=1, max_blocks=100)) == 1
    assert pick_warm(offers, n=5, max_blocks=0) == []


def test_salted_and_adapter_prefixes_stay_apart() -> None:
    served = ServedPrefixes()
    tenant, adapter = HashContext("m", cache_salt="t1"), HashContext("m", lora_id="x@1")
    for ctx in (CTX, tenant, adapter):
        for q in range(2):
            served.note(ctx, keys(SYS_A + [q] * 4, ctx))
    hot = served.hot(5)
    assert {h.ctx for h in hot} == {CTX, tenant, adapter}
    assert all(h.keys == keys(SYS_A, h.ctx) and h.uses == 2 for h in hot)


def test_a_full_table_holds_nothing_the_collector_scans() -> None:
    """Thousands of served prompts, each under its own context object: once collected, the
    tables add no tracked objects (a full collection's cost does not grow with them), and
    the hot list rebuilds the contexts and keys as they were noted."""
    import gc

    served = ServedPrefixes(max_prompts=3000)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(3000):
        served.note(HashContext("m", None, f"tenant-{i % 7}"), keys([i, i + 1] * 4))
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    top = served.hot(1)[0]
    assert top == HotPrefix(HashContext("m", None, "tenant-3"), keys([2999, 3000] * 4), 1)
