"""Draft slots: unverified tokens never hashed or cached; settling keeps the verified ones."""

from __future__ import annotations

from kvstore.blocks.hashing import HashContext
from worker.kv import KVCacheManager


def test_draft_slots_are_never_cached_and_settle_keeps_the_verified() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    toks = [1, 2, 3, 4, 5, 6]
    assert kv.allocate_slots("s", toks, 6, ctx=HashContext()) is not None
    assert kv.append_draft_slots("s", 5)  # slots 6..10: a third block
    assert len(kv.block_table("s")) == 3
    kv.drain_events()
    # two drafts accepted, plus the model's own token: 9 tokens, 8 verified-computed
    verified = toks + [7, 8, 9]
    kv.settle_drafts("s", verified, 8)
    assert kv.num_computed_tokens("s") == 8
    assert len(kv.block_table("s")) == 2  # the third (draft-only) block went back
    events = kv.drain_events()
    assert len(events) == 1  # block 2 cached with the verified tokens 5..8 only
    kv.check_invariants()
    assert not kv.append_draft_slots("s", 100)  # does not fit: unchanged
    assert kv.num_computed_tokens("s") == 8
    kv.check_invariants()
