"""One sequence's hold on the KV cache: its block table, computed tokens and key chain."""

from __future__ import annotations

from kvstore.blocks.hashing import BlockKey, HashContext
from worker.kv.free_queue import KVBlock


class SeqBlocks:
    """Per-sequence state of the KV manager: its blocks, computed tokens and the chain of
    full-block keys (the manager's alone; read it through the manager's queries)."""

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
