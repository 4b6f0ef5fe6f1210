"""The KV tiers: where a worker can hold a cached block, fastest first.

One vocabulary for every layer: KV events carry the tier a block entered or left, the index
records and looks up keys per tier (the tier's value is the string its Lua scripts and records
use), the router prices a hit by the tier that holds it, and metrics label cached tokens by it.
``PEER`` is not held by a worker's own manager: it names tokens that came from another worker's
tier through a pull, so counters of cached tokens by source can say so.

A worker holds each key in at most one of its own tiers; a block moves down the list when it is
evicted from the tier above (store on eviction) and back to ``DEVICE`` when a request uses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class Tier(StrEnum):
    """A place KV blocks live; members are ordered fastest first (``Tier.rank``)."""

    DEVICE = "device"  # the paged KV cache the model computes in (GPU memory, or CPU RAM)
    HOST = "host"  # host memory: blocks evicted from the device, loaded back by a copy
    DISK = "disk"  # local storage below host memory: blocks evicted from the host
    PEER = "peer"  # another worker's tiers, reached by a pull (a source, never a holder)

    @property
    def rank(self) -> int:
        """0 for the fastest tier; a lower rank is always preferred for the same key."""
        return _RANK[self]

    @classmethod
    def parse(cls, value: str) -> Tier:
        """The tier named ``value``; a clear error listing the valid names otherwise."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(t.value for t in cls)
            raise ValueError(f"unknown KV tier {value!r}: valid tiers are {valid}") from None


_RANK = {tier: i for i, tier in enumerate(Tier)}

# The tiers a worker's own KV manager can hold a block in, fastest first.
HELD_TIERS: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK)

TierBlocks = Mapping[Tier, int]
"""Leading blocks of one prompt that a worker holds, per tier (an index lookup's answer per
worker). Tiers in rank order each continue the faster ones: with ``{DEVICE: d, HOST: h}``
blocks ``0..d-1`` are on its device and ``d..d+h-1`` in its host tier. A tier not named holds
none of them."""
