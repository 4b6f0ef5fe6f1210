"""How long cached KV blocks live, sampled: vLLM's residency histograms
(``kv_block_lifetime``, ``kv_block_idle_before_evict``, ``kv_block_reuse_gap``).

Every ``stride``-th physical block carries a :class:`BlockSample`; the block pool reports that
block's events here (cached, touched by a prefix hit, freed, evicted, cleared) and every other
block costs the pool one ``is None`` test per event. Block ids are independent of what a block
holds and of its place in the LRU, so a fixed set of physical blocks samples residencies
without bias. A twin (an uncached duplicate that later serves its key) is not sampled.

- lifetime: cached (its key registered) to evicted;
- idle before evict: its ref count's last drop to 0 to evicted (its time in the LRU);
- reuse gap: between two uses of the cached block (its caching, then each prefix hit).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvstore.requests.histograms import Histogram, HistogramCounts
from worker.kv.free_queue import KVBlock

# seconds: from blocks reused within a step to cold prefixes kept for hours
BLOCK_BUCKETS_S = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
DEFAULT_SAMPLE_STRIDE = 16


class BlockSample:
    """One sampled block's times while it is cached (``born`` None: not cached)."""

    __slots__ = ("born", "last_use", "freed")

    def __init__(self) -> None:
        self.born: float | None = None  # when its key was registered
        self.last_use = 0.0  # its caching or its last prefix hit
        self.freed: float | None = None  # when its ref count last dropped to 0


class BlockLifetimes:
    """The three residency histograms of one block pool's sampled blocks (the pool's thread
    only)."""

    def __init__(
        self,
        blocks: Sequence[KVBlock],
        stride: int = DEFAULT_SAMPLE_STRIDE,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``stride``: sample every stride-th block (1: all; 0: none); ``clock``: seconds
        (default ``time.monotonic``)."""
        if stride < 0:
            raise ValueError(f"stride must be >= 0 (0: no block sampled), got {stride}")
        self.stride = stride
        self._clock = clock or time.monotonic
        self.lifetime = Histogram(BLOCK_BUCKETS_S)
        self.idle_before_evict = Histogram(BLOCK_BUCKETS_S)
        self.reuse_gap = Histogram(BLOCK_BUCKETS_S)
        self._counts: dict[str, HistogramCounts] | None = None  # until the next observation
        for block in blocks[::stride] if stride else ():
            block.sample = BlockSample()

    def cached(self, s: BlockSample) -> None:
        s.born = s.last_use = self._clock()
        s.freed = None

    def used(self, s: BlockSample) -> None:
        """A prefix hit takes the cached block."""
        if s.born is None:
            return
        now = self._clock()
        self.reuse_gap.observe(now - s.last_use)
        self._counts = None
        s.last_use = now

    def freed(self, s: BlockSample) -> None:
        if s.born is not None:
            s.freed = self._clock()

    def evicted(self, s: BlockSample) -> None:
        born = s.born
        if born is None:
            return
        now = self._clock()
        self.lifetime.observe(now - born)
        self.idle_before_evict.observe(now - (s.freed if s.freed is not None else now))
        self._counts = None
        s.born = s.freed = None

    @staticmethod
    def cleared(s: BlockSample) -> None:
        """Its key dropped without an eviction (a cache reset, a key a twin serves now)."""
        s.born = s.freed = None

    def histograms(self) -> dict[str, HistogramCounts]:
        """By vLLM's name less its ``vllm:`` and ``_seconds`` (one dict while nothing
        changes; callers never mutate it)."""
        if self._counts is None:
            self._counts = {
                "kv_block_lifetime": self.lifetime.counts_now(),
                "kv_block_idle_before_evict": self.idle_before_evict.counts_now(),
                "kv_block_reuse_gap": self.reuse_gap.counts_now(),
            }
        return self._counts
