"""The disk tier's admission rule, shared by the real tier (``disk_store``) and the
simulator's: ``admit_after`` 1 writes a block when first offered, 2 when offered a second time
while still remembered (at most the "seen twice" of Dynamo's admit-on-presence, which replaced
a frequency filter that starved its disk tier)."""

from __future__ import annotations

from collections import OrderedDict

from kvstore.blocks.hashing import BlockKey

SEEN_KEYS_MAX = 1 << 20  # admission memory bound (keys offered once)


class DiskAdmission:
    """Which offered blocks are written; remembers the keys offered once, oldest forgotten
    first, up to ``4 * capacity_blocks`` (at least 1,024, at most ``SEEN_KEYS_MAX``)."""

    __slots__ = ("admit_after", "_seen", "_seen_max")

    def __init__(self, admit_after: int, capacity_blocks: int) -> None:
        if admit_after not in (1, 2):
            raise ValueError(
                f"admit_after={admit_after}: 1 writes a block when first offered, 2 when "
                "offered a second time"
            )
        self.admit_after = admit_after
        self._seen: OrderedDict[BlockKey, None] = OrderedDict()
        self._seen_max = min(SEEN_KEYS_MAX, max(1024, 4 * capacity_blocks))

    def admit(self, key: BlockKey) -> bool:
        """Whether ``key``'s block is written now (False: remembered for its next offer)."""
        if self.admit_after == 1:
            return True
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self._seen_max:
            self._seen.popitem(last=False)
        return False
