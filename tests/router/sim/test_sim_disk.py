"""The simulator's disk tier: its own rules (LRU files within a budget, files kept under
blocks loaded back, admission on the second offer), and inside a simulated worker's real KV
manager (store on eviction from the host, a hit loaded when the read beats recomputing and
timed as the time model says, the router pricing disk hits by its own tier weights)."""

from __future__ import annotations

import pytest

from kvstore.blocks.events import BlockRemoved, BlockStored, EventLog
from kvstore.blocks.hashing import BlockKey
from kvstore.blocks.tiers import Tier
from router import RoutingConfig
from router.placement.config import TIER_HIT_WEIGHTS
from router.sim import SimConfig, SimRequest, SimWorker, TimeModel, replay, tier_hit_rates
from router.sim.disk_tier import SimDiskTier
from router.sim.replay import kv_manager
from tests.router.harness import tokens

BS = 16
TM = TimeModel(  # as test_sim.py: 1 ms per prompt token, 10 ms per step
    step_overhead_s=0.01,
    prefill_s_per_token=0.001,
    attn_s_per_token_pair=0.0,
    decode_s_per_ctx_token=0.0,
    max_batched_tokens=64,
    max_running=4,
)


def _key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


def _tier(num_blocks: int, admit_after: int = 1) -> tuple[SimDiskTier, EventLog]:
    events = EventLog()
    tier = SimDiskTier(num_blocks, BS, events, load_s_per_token=1e-6, admit_after=admit_after)
    return tier, events


def _store(tier: SimDiskTier, i: int) -> int | None:
    return tier.store(_key(i), _key(i - 1) if i else None, (i,) * BS, None)


def test_lru_files_within_the_budget_a_read_makes_a_file_recent() -> None:
    tier, events = _tier(2)
    assert _store(tier, 0) is not None and _store(tier, 1) is not None
    tier.refresh([_key(0)])  # block 0 read recently: block 1 is the oldest now
    _store(tier, 2)
    assert set(tier.files) == {_key(0), _key(2)} and set(tier.keys()) == {_key(0), _key(2)}
    removed = [e for e in events.drain() if isinstance(e, BlockRemoved)]
    assert [(e.keys, e.tier) for e in removed] == [((_key(1),), Tier.DISK)]
    assert tier.stats().evicted_blocks == 1
    tier.check_invariants(set())


def test_a_block_loaded_back_keeps_its_file_and_comes_down_again_without_a_write() -> None:
    tier, events = _tier(4)
    _store(tier, 0)
    block = tier.get(_key(0))
    assert block is not None
    tier.checkout([block])  # loaded to the device: no longer served, its file stays
    assert _key(0) not in tier and _key(0) in tier.files
    tier.discard([_key(0)])  # the same batch: the device caches it now, the file stays
    tier.release_pinned()
    assert _store(tier, 0) is None and _key(0) in tier  # evicted again: served at once
    assert tier.stats().stored_blocks == 1 and tier.stats().loaded_blocks == 1
    stored = [e for e in events.drain() if isinstance(e, BlockStored)]
    assert len(stored) == 2 and all(e.tier is Tier.DISK for e in stored)
    tier.discard([_key(0)])  # recomputed on the device (not loaded from here): file goes
    assert _key(0) not in tier.files
    tier.check_invariants(set())


def test_admit_after_two_writes_a_block_on_its_second_offer() -> None:
    tier, _ = _tier(4, admit_after=2)
    assert _store(tier, 0) is None and _key(0) not in tier
    assert _store(tier, 0) is not None and _key(0) in tier
    assert tier.num_not_admitted == 1 and tier.stats().stored_blocks == 1
    with pytest.raises(ValueError, match="admit_after=3"):
        SimDiskTier(4, BS, EventLog(), load_s_per_token=0.0, admit_after=3)


def _worker(tm: TimeModel = TM, disk_blocks: int = 16) -> SimWorker:
    sim = SimConfig(
        num_workers=1,
        kv_tokens_per_worker=4 * BS,
        host_kv_tokens_per_worker=4 * BS,
        disk_kv_tokens_per_worker=disk_blocks * BS,
        block_size=BS,
        time=tm,
    )
    return SimWorker("w0", kv_manager(sim), tm)


def _push_down(worker: SimWorker, prompts: list[list[int]]) -> list:
    """One at a time, each alone: 4 blocks each, so every one evicts the one before."""
    out = []
    for i, prompt in enumerate(prompts):
        rec = worker.submit(SimRequest(f"r{i}", 100.0 * i, prompt, output_len=1), 0, ())
        worker.advance(100.0 * i + 50)
        out.append(rec)
    return out


def test_a_prefix_the_host_evicted_is_loaded_back_from_disk_and_the_load_timed() -> None:
    worker = _worker()
    a = tokens(1, 3 * BS + 1)  # 3 full blocks
    recs = _push_down(worker, [a] + [tokens(10 + i, 3 * BS + 1) for i in range(3)] + [a])
    disk = worker.kv.tiers.get(Tier.DISK)
    assert isinstance(disk, SimDiskTier)
    again = recs[-1]
    assert (again.cached_tokens, again.tier_cached_tokens) == (3 * BS, {Tier.DISK: 3 * BS})
    ttft = again.first_token_s - again.arrival_s
    assert ttft == pytest.approx(TM.idle_ttft_s(len(a), 3 * BS, {Tier.DISK: 3 * BS}))
    assert TM.load_s({Tier.DISK: 3 * BS}) > 0  # the load is in that TTFT
    assert disk.stats().loaded_blocks == 3 and disk.num_skipped == 0
    worker.kv.check_invariants()
    assert worker.load(500.0).tier_blocks == {Tier.HOST: 4, Tier.DISK: 16}


def test_a_disk_slower_than_recomputing_is_left_to_recompute() -> None:
    # the engine's rule (TierChain.worth_loading): reading 48 tokens at 2 ms each loses to
    # recomputing them at 1 ms each
    slow = TimeModel(**{**TM.model_dump(), "tier_load_s_per_token": {Tier.DISK: 0.002}})
    worker = _worker(slow)
    a = tokens(1, 3 * BS + 1)
    recs = _push_down(worker, [a] + [tokens(10 + i, 3 * BS + 1) for i in range(3)] + [a])
    disk = worker.kv.tiers.get(Tier.DISK)
    assert isinstance(disk, SimDiskTier)
    assert (recs[-1].cached_tokens, recs[-1].tier_cached_tokens) == (0, {})
    assert disk.num_skipped == 3 and disk.stats().loaded_blocks == 0
    # a tier not given keeps its default figure
    assert slow.tier_load_s_per_token[Tier.HOST] == TM.tier_load_s_per_token[Tier.HOST]


def test_a_disk_budget_smaller_than_the_working_set_loses_the_oldest_prefix() -> None:
    worker = _worker(disk_blocks=4)
    a = tokens(1, 3 * BS + 1)
    recs = _push_down(worker, [a] + [tokens(10 + i, 3 * BS + 1) for i in range(4)] + [a])
    assert recs[-1].cached_tokens == 0
    worker.kv.check_invariants()


def test_the_router_prices_a_disk_hit_by_its_own_tier_weight() -> None:
    # host hits weigh nothing here: only the disk tier the load names makes the router ask
    # the index for lower tiers, and a disk block counts as the router's default disk weight
    sim = SimConfig(
        num_workers=1,
        kv_tokens_per_worker=4 * BS,
        host_kv_tokens_per_worker=4 * BS,
        disk_kv_tokens_per_worker=16 * BS,
        block_size=BS,
        event_delay_s=0.0,
        time=TM,
    )
    a = tokens(1, 3 * BS + 1)
    prompts = [a] + [tokens(10 + i, 3 * BS + 1) for i in range(3)] + [a]
    requests = [SimRequest(f"r{i}", 100.0 * i, p, output_len=1) for i, p in enumerate(prompts)]
    routing = RoutingConfig(policy="prefix_affinity", tier_hit_weights={"host": 0.0})
    assert routing.tier_hit_weights[Tier.DISK] == TIER_HIT_WEIGHTS[Tier.DISK]
    result = replay(requests, routing, sim)
    again = result.records[-1]
    assert again.tier_cached_tokens == {Tier.DISK: 3 * BS}
    assert again.expected_cached == int(TIER_HIT_WEIGHTS[Tier.DISK] * 3 * BS)
    rates = tier_hit_rates(result.records)
    prompt = sum(len(p) for p in prompts)
    assert rates == {Tier.DEVICE: 0.0, Tier.HOST: 0.0, Tier.DISK: 3 * BS / prompt}


def test_a_disk_tier_needs_a_host_tier() -> None:
    with pytest.raises(ValueError, match="disk_kv_tokens_per_worker=64 needs host_kv_tokens"):
        SimConfig(disk_kv_tokens_per_worker=64)
