"""The router prices a cached block by the tier that holds it, through one table
(``routing.tier_hit_weights``), for any tier of ``HELD_TIERS``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvstore.blocks.events import BlockRemoved, BlockStored
from kvstore.blocks.hashing import block_keys
from kvstore.blocks.tiers import Tier
from router import InMemoryPrefixIndex, RoutingConfig
from router.placement.cached import cached_tokens, held_blocks


def test_default_weights_and_partial_overrides() -> None:
    assert RoutingConfig().tier_hit_weights == {Tier.DEVICE: 1.0, Tier.HOST: 0.5, Tier.DISK: 0.25}
    cfg = RoutingConfig(tier_hit_weights={"disk": 0.1})
    assert cfg.tier_hit_weights == {Tier.DEVICE: 1.0, Tier.HOST: 0.5, Tier.DISK: 0.1}


@pytest.mark.parametrize(
    ("weights", "says"),
    [
        ({"tape": 0.1}, "valid tiers are device, host, disk, peer"),
        ({"peer": 0.5}, "holds no block"),
        ({"host": 1.5}, "must be in [0, 1]"),
    ],
)
def test_bad_weights_are_refused_with_the_fix(weights: dict, says: str) -> None:
    with pytest.raises(ValidationError, match=says.replace("[", r"\[").replace("]", r"\]")):
        RoutingConfig(tier_hit_weights=weights)


def test_each_tier_weighs_its_own_blocks_up_to_the_cap() -> None:
    index = {
        "a": {Tier.DEVICE: 2, Tier.HOST: 2, Tier.DISK: 4},  # 8 blocks over three tiers
        "b": {Tier.DISK: 8},
        "c": {},
    }
    weights = RoutingConfig().tier_hit_weights
    out, assisted = cached_tokens(["a", "b", "c", "d"], 16 * 7 + 1, 16, index, {}, weights)
    # cap: 7 blocks (the last prompt token is always recomputed); a's 4th disk block is cut
    assert out == {"a": int((2 + 0.5 * 2 + 0.25 * 3) * 16), "b": int(0.25 * 7 * 16), "c": 0, "d": 0}
    assert not assisted
    held = held_blocks(["a", "b", "d"], 16 * 7 + 1, 16, index, {"d": 3})
    assert held == {"a": (2, 7), "b": (0, 7), "d": (3, 0)}


def test_in_memory_index_counts_every_held_tier_as_redis_does() -> None:
    keys = block_keys(list(range(48)), 4)  # 12 blocks
    index = InMemoryPrefixIndex()
    index.apply(
        "a",
        [
            BlockStored(0, tuple(keys[:3]), None, (), 4),
            BlockStored(1, tuple(keys[3:6]), keys[2], (), 4, Tier.HOST),
            BlockStored(2, tuple(keys[6:10]), keys[5], (), 4, Tier.DISK),
        ],
    )
    index.apply("b", [BlockStored(0, tuple(keys[:5]), None, (), 4, Tier.DISK)])
    assert index.lookup(keys) == {"a": 3}
    assert index.lookup_tiers(keys) == {
        "a": {Tier.DEVICE: 3, Tier.HOST: 3, Tier.DISK: 4},
        "b": {Tier.DISK: 5},
    }
    index.apply("a", [BlockRemoved(3, tuple(keys[8:10]), Tier.DISK)])
    assert index.lookup_tiers(keys)["a"] == {Tier.DEVICE: 3, Tier.HOST: 3, Tier.DISK: 2}
