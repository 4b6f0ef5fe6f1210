"""Physical KV blocks and the pool's free queue: an intrusive doubly linked list, because a
cached free block must leave the middle of the LRU order in O(1) when it is hit again."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from kvstore.blocks.hashing import BlockKey

if TYPE_CHECKING:
    from worker.kv.block_lifetimes import BlockSample


class BlockPoolError(RuntimeError):
    """The pool was misused (double release, double insert, popping an empty queue, ...).

    Raised explicitly, not by ``assert``, so ``python -O`` keeps the checks; raised before
    anything changes, so the free queue and the ref counts stay intact.
    """


class KVBlock:
    """One physical block: its id, ref count, cache key and free-queue links."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "key",
        "twin_of",
        "token_ids",
        "tenant",
        "parent",
        "pulled",
        "landing",
        "children",
        "sample",
        "prev",
        "next",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id  # index into the model runner's KV tensors; never changes
        self.ref_cnt = 0  # number of block tables holding this block
        self.key: BlockKey | None = None  # prefix-cache key while cached, else None
        self.twin_of: BlockKey | None = None  # key served by another block while this is a twin
        self.token_ids: tuple[int, ...] | None = None  # tokens of a cached block or a twin
        self.tenant: str | None = None  # cache_salt of the prompt that cached it (quotas)
        self.parent: BlockKey | None = None  # key before ``key`` (a host tier names it)
        # a spare copy: another worker keeps this block (pulled from a peer and used, or the
        # index says a peer keeps it), or it is cached under such a block
        self.pulled = False
        self.landing = False  # pulled, not yet used by the request it was pulled for
        self.children = 0  # cached blocks whose parent key is this block's key
        self.sample: BlockSample | None = None  # its residency times, if sampled
        self.prev: KVBlock | None = None  # free-queue links; None while not in the queue
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        key = self.key.hex()[:8] if self.key is not None else None
        twin = f", twin_of={self.twin_of.hex()[:8]}" if self.twin_of is not None else ""
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, key={key}{twin})"


class FreeBlockQueue:
    """Free blocks in eviction order, as a hand-made doubly linked list through the blocks.

    Why not a deque or a list: a prefix hit on a cached block that is currently free (ref count
    0, waiting to be evicted) must take that block out of the *middle* of the queue. With a
    deque that is an O(n) scan per hit block — a 2k-token prompt hitting 128 blocks in a pool of
    100k blocks would scan millions of entries. With the links stored on the blocks themselves,
    removal from anywhere, push to either end and pop from the front are all O(1) and allocate
    nothing. Sentinel nodes at both ends remove every edge case from the link updates.

    A third sentinel, ``_mid``, splits the cached blocks in two: spare copies, which another
    worker keeps (pulled from a peer, or named by the index; ``append_pulled``, least
    recently used first), go before the rest (``append``), so a spare is evicted before any
    block the fleet may hold nowhere else; blocks with nothing to keep (``appendleft``) go
    before both. A copy that has just landed queues with the computed blocks until something
    uses it (the request it was pulled for is still waiting for its turn: evicting its pull
    first would waste the pull and recompute the prefix after all).

    A fourth sentinel, ``_keep``, ends the rest: behind it queue the *claimed* blocks, whose
    keys a waiting request's prompt names (``append_claimed`` at the back,
    ``appendleft_claimed`` at the front of that run), evicted only when nothing else is left:
    the prefix a request was queued for survives until it runs.
    """

    __slots__ = ("_head", "_mid", "_keep", "_tail", "_len")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._mid = KVBlock(-1)
        self._keep = KVBlock(-1)
        self._tail = KVBlock(-1)
        chain = (self._head, self._mid, self._keep, self._tail)
        for a, b in zip(chain, chain[1:], strict=False):
            a.next, b.prev = b, a
        self._len = 0
        for block in blocks:  # never used: before every cached block
            self.append_pulled(block)

    def __len__(self) -> int:
        return self._len

    def _link_after(self, node: KVBlock, block: KVBlock) -> None:
        if block.prev is not None or block.next is not None:
            raise BlockPoolError(f"{block} is already in the free queue")
        after = node.next
        if after is None:
            raise BlockPoolError(f"{node} is not linked into the free queue")
        block.prev, block.next = node, after
        node.next = block
        after.prev = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        """Push to the back of the unclaimed blocks (evicted after every other of them)."""
        self._link_before(self._keep, block)

    def append_claimed(self, block: KVBlock) -> None:
        """Push to the back of the claimed blocks (evicted last of all)."""
        self._link_before(self._tail, block)

    def appendleft_claimed(self, block: KVBlock) -> None:
        """Push to the front of the claimed blocks (after every unclaimed block)."""
        self._link_after(self._keep, block)

    def _link_before(self, node: KVBlock, block: KVBlock) -> None:
        before = node.prev
        if before is None:  # pragma: no cover - the sentinels are always linked
            raise BlockPoolError("free queue's sentinels are unlinked")
        self._link_after(before, block)

    def appendleft(self, block: KVBlock) -> None:
        """Push to the front (handed out first)."""
        self._link_after(self._head, block)

    def append_pulled(self, block: KVBlock) -> None:
        """Push to the back of the pulled copies (after them, before every other cached
        block)."""
        self._link_before(self._mid, block)

    def remove(self, block: KVBlock) -> None:
        """Take ``block`` out from anywhere in the queue in O(1)."""
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None or block.block_id < 0:
            raise BlockPoolError(f"{block} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        while block is self._mid or block is self._keep:
            block = block.next
        if block is None or block is self._tail:
            raise BlockPoolError("popleft from an empty free queue")
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            if node is not self._mid and node is not self._keep:
                yield node
            node = node.next
