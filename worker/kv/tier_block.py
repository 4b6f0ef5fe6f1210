"""One block a lower tier holds (host memory, disk, ...): its id in that tier and what it caches."""

from __future__ import annotations

from kvstore.blocks.hashing import BlockKey


class TierBlock:
    """A cached block in a tier below the device: its id there and the key it caches."""

    __slots__ = ("block_id", "key", "parent", "token_ids", "tenant")

    def __init__(
        self,
        block_id: int,
        key: BlockKey,
        parent: BlockKey | None,
        token_ids: tuple[int, ...],
        tenant: str | None,
    ) -> None:
        self.block_id = block_id  # index into the tier's storage (the runner's host tensors, ...)
        self.key = key
        self.parent = parent  # key of the block before it (events name it for the index)
        self.token_ids = token_ids  # compared on a hit: a collision can never load wrong KV
        self.tenant = tenant  # cache_salt owner of the prompt that cached it (quotas)

    def __repr__(self) -> str:
        return f"TierBlock(id={self.block_id}, key={self.key.hex()[:8]})"
