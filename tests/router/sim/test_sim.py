"""The trace-replay simulator: exact step timing, cache hits through a real KV manager,
event-delayed index, parity during replay."""

from __future__ import annotations

import pytest

from kvstore.blocks.tiers import Tier
from router import RoutingConfig
from router.sim import SimConfig, SimRequest, SimWorker, TimeModel, replay, summarize
from tests.router.harness import tokens
from worker.kv import BlockStored, KVCacheManager

# 1 ms per prompt token, 10 ms per step, 64 tokens per step: easy to add up by hand.
TM = TimeModel(
    step_overhead_s=0.01,
    prefill_s_per_token=0.001,
    attn_s_per_token_pair=0.0,
    decode_s_per_ctx_token=0.0,
    max_batched_tokens=64,
    max_running=4,
)


def test_sim_worker_exact_steps_and_prefix_hit() -> None:
    worker = SimWorker("w0", KVCacheManager(64, 16), TM)
    a = worker.submit(SimRequest("a", 0.0, tokens(1, 100), output_len=3), 0, ())
    assert worker.load(0.0).queued_prefill_tokens == 100
    worker.advance(0.05)  # step 1 (0 -> 0.074) starts before 0.05 and runs to its end
    assert worker.clock == pytest.approx(0.074)
    assert worker.load(0.05).queued_prefill_tokens == 100  # 64 in flight + 36 queued
    assert worker.load(0.08).queued_prefill_tokens == 36
    worker.advance(1.0)
    # step 2: 36 tokens -> first token at 0.074 + 0.046; two decode steps of 10 ms.
    assert (a.first_token_s, a.finish_s) == (pytest.approx(0.12), pytest.approx(0.14))
    assert (a.cached_tokens, worker.computed_prefill_tokens) == (0, 100)
    published = worker.take_events()
    assert published[0][0] == pytest.approx(0.074)  # published at the end of its step
    assert [len(e.keys) for _, batch in published for e in batch if isinstance(e, BlockStored)] == [
        6
    ]

    # Same 100 tokens + 20: the 6 full blocks (96 tokens) hit; 24 computed in one step.
    b = worker.submit(SimRequest("b", 1.0, tokens(1, 100) + tokens(2, 20), 1), 96, ())
    assert worker.load(1.0).queued_prefill_tokens == 24
    worker.advance(2.0)
    assert b.cached_tokens == 96 and b.first_token_s - b.arrival_s == pytest.approx(0.034)
    assert worker.idle() and worker.computed_prefill_tokens == 124


def test_idle_ttft_is_a_lone_requests_simulated_ttft() -> None:
    # The zero-queueing bound the host-tier benchmark reports: exact for a request alone,
    # with the default (attention-aware) time model, cold, from a device hit, from a host hit.
    assert TM.idle_ttft_s(100, 0) == pytest.approx(0.12)  # the hand-counted steps above
    assert TM.idle_ttft_s(96, 96) == pytest.approx(0.01)  # all cached: one step
    tm = TimeModel()
    kv = KVCacheManager(16, 512, host_num_blocks=32)
    worker = SimWorker("w0", kv, tm)
    runs = [("a", tokens(1, 5000)), ("b", tokens(1, 5000) + tokens(2, 700))]
    runs += [(f"x{i}", tokens(10 + i, 2600)) for i in range(3)]  # push a's blocks to host
    runs += [("c", tokens(1, 5000) + tokens(3, 300))]
    for i, (rid, prompt) in enumerate(runs):
        rec = worker.submit(SimRequest(rid, 100.0 * i, prompt, output_len=1), 0, ())
        worker.advance(100.0 * i + 50)
        ttft = rec.first_token_s - rec.arrival_s
        assert ttft == pytest.approx(
            tm.idle_ttft_s(len(prompt), rec.cached_tokens, rec.tier_cached_tokens)
        )
    assert (rec.cached_tokens, rec.tier_cached_tokens) == (4608, {Tier.HOST: 4608})


def test_sim_worker_waiting_load_counts_cached_prefix_only_when_asked() -> None:
    # The engine's pending_prefill_tokens counts a waiting prompt whole; "uncached" counts
    # what the worker will compute. Once admitted both count the uncached tail only.
    loads = {}
    for rule in ("uncached", "whole"):
        worker = SimWorker("w0", KVCacheManager(64, 16), TM, waiting_load=rule)
        worker.submit(SimRequest("a", 0.0, tokens(1, 100), output_len=1), 0, ())
        worker.advance(1.0)
        worker.submit(SimRequest("b", 1.0, tokens(1, 100) + tokens(2, 20), 1), 96, ())
        waiting = worker.load(1.0).queued_prefill_tokens
        worker.advance(1.01)  # step 1.0 -> 1.034 admits b and computes its 24 tokens
        in_flight = worker.load(1.01).queued_prefill_tokens
        worker.advance(2.0)
        loads[rule] = (waiting, in_flight, worker.load(2.0).queued_prefill_tokens)
    assert loads == {"uncached": (24, 24, 0), "whole": (120, 24, 0)}
    with pytest.raises(ValueError, match="waiting_load"):
        SimWorker("w1", KVCacheManager(4, 16), TM, waiting_load="all")


def test_sim_worker_counts_a_prefix_shared_in_its_queue_once() -> None:
    # As the engine: a sibling queued behind the request that will cache its prefix counts
    # only its tail, and the prefix is computed once.
    worker = SimWorker("w0", KVCacheManager(64, 16), TM)
    worker.submit(SimRequest("a", 0.0, tokens(1, 100), output_len=1), 0, ())
    b = worker.submit(SimRequest("b", 0.0, tokens(1, 100) + tokens(2, 20), 1), 0, ())
    assert worker.load(0.0).queued_prefill_tokens == 100 + 24
    worker.advance(5.0)
    assert worker.idle() and b.cached_tokens == 96
    assert worker.computed_prefill_tokens == 124 and worker.load(5.0).queued_prefill_tokens == 0


def _pair(gap_s: float) -> list[SimRequest]:
    doc = tokens(5, 2000)
    return [
        SimRequest("first", 0.0, doc + tokens(6, 10), 2),
        SimRequest("sibling", gap_s, doc + tokens(7, 10), 2),
    ]


@pytest.mark.parametrize(("ttl", "hits"), [(5.0, True), (0.0, False)])
def test_replay_sibling_before_events_needs_pending_placements(ttl: float, hits: bool) -> None:
    # The sibling arrives 50 ms later; the first request's KV events need 1 s to arrive.
    sim = SimConfig(num_workers=4, kv_tokens_per_worker=16_384, block_size=16, event_delay_s=1.0)
    routing = RoutingConfig(policy="prefix_affinity", pending_ttl_s=ttl, seed=1)
    result = replay(_pair(0.05), routing, sim)
    first, sibling = result.records
    assert (sibling.worker_id == first.worker_id) is hits
    assert (sibling.cached_tokens == 2000) is hits
    assert sibling.expected_cached == (2000 if hits else 0)


def test_replay_reports_and_parity_holds() -> None:
    sim = SimConfig(num_workers=2, kv_tokens_per_worker=16_384, block_size=16, event_delay_s=0.0)
    result = replay(_pair(5.0), RoutingConfig(policy="prefix_affinity"), sim)
    summary = summarize(result)
    assert summary.requests == 2 and summary.rejected == 0
    # The sibling arrives after the events: the index (not pending) routes it to the holder.
    assert summary.hit_rate == pytest.approx(2000 / 4020)
    assert result.router_metrics["parity_checks"] == 2
    assert summary.parity_mismatches == 0 and result.index_gaps == 0
    assert summary.predicted_hit_error == 0.0
    with pytest.raises(ValueError, match="arrival order"):
        replay(list(reversed(_pair(1.0))), RoutingConfig(), sim)
