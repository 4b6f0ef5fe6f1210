"""Sampled KV block residency: lifetime (cached to evicted), idle before eviction (last
release to evicted) and reuse gap (between uses), under a workload that evicts and reuses,
on a clock the test moves."""

from __future__ import annotations

import time

import pytest

from kvstore.requests.histograms import HistogramCounts
from worker.kv import HashContext, KVCacheManager
from worker.kv.block_lifetimes import BLOCK_BUCKETS_S

BS = 2
CTX = HashContext(model_id="m")
A = [10, 11, 12, 13, 14]  # two full blocks and a partial one (a hit leaves it)
B = [20, 21, 22, 23, 24, 25, 26, 27]  # four: takes the whole pool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(time, "monotonic", c)  # read when the pool is built
    return c


def _prefill(kv: KVCacheManager, sid: str, tokens: list[int]) -> None:
    hit = kv.lookup_prefix(tokens, CTX)
    alloc = kv.allocate_slots(sid, tokens, len(tokens) - hit.num_tokens, ctx=CTX, prefix=hit)
    assert alloc is not None


def _values(h: HistogramCounts) -> list[float]:
    """The upper bound of each observation's bucket."""
    return [b for b, n in zip(BLOCK_BUCKETS_S, h.counts, strict=False) for _ in range(n)]


def test_eviction_and_reuse_are_measured(clock: Clock) -> None:
    kv = KVCacheManager(4, BS, block_sample_stride=1)
    _prefill(kv, "a", A)  # t=0: both full blocks cached
    clock.now = 1.0
    kv.free("a")  # unused from t=1
    clock.now = 4.0
    _prefill(kv, "b", A)  # a prefix hit: each block reused after 4 s
    clock.now = 5.0
    kv.free("b")
    h = kv.stats().block_histograms
    assert h["kv_block_reuse_gap"].count == 2 and h["kv_block_reuse_gap"].sum == 8.0
    assert h["kv_block_lifetime"].count == 0  # nothing evicted yet
    clock.now = 35.0
    _prefill(kv, "c", B)  # needs every block: the two cached ones are evicted
    h = kv.stats().block_histograms
    assert h["kv_block_lifetime"].sum == 70.0 and _values(h["kv_block_lifetime"]) == [60.0] * 2
    assert h["kv_block_idle_before_evict"].sum == 60.0
    assert _values(h["kv_block_idle_before_evict"]) == [30.0] * 2


def test_only_every_stride_th_block_is_sampled(clock: Clock) -> None:
    kv = KVCacheManager(4, BS, block_sample_stride=2)
    assert [b.sample is not None for b in kv.pool.blocks] == [True, False, True, False]
    _prefill(kv, "a", A)  # blocks 0 and 1
    kv.free("a")
    clock.now = 2.0
    _prefill(kv, "b", A)
    assert kv.stats().block_histograms["kv_block_reuse_gap"].count == 1  # block 0's


def test_stride_zero_samples_nothing(clock: Clock) -> None:
    kv = KVCacheManager(4, BS, block_sample_stride=0)
    _prefill(kv, "a", A)
    kv.free("a")
    _prefill(kv, "b", A)
    kv.free("b")
    _prefill(kv, "c", B)
    assert all(b.sample is None for b in kv.pool.blocks)
    assert all(h.count == 0 for h in kv.stats().block_histograms.values())


def test_a_cache_reset_is_no_eviction(clock: Clock) -> None:
    kv = KVCacheManager(4, BS, block_sample_stride=1)
    _prefill(kv, "a", A)
    kv.free("a")
    assert kv.reset_prefix_cache()
    clock.now = 9.0
    _prefill(kv, "c", B)
    assert kv.stats().block_histograms["kv_block_lifetime"].count == 0
