"""What a router's status surfaces show of one worker: the ClusterStatus entry (``kvcluster
status`` prints it) and the ``/metrics`` gauges carry the worker's status and this router's
prediction counters, the room-check and pull-eviction figures among them."""

from __future__ import annotations

from kvstore.blocks.tiers import Tier
from kvstore.requests.protocol import AdapterInfo, TierFigures, WorkerStatus
from router.edge.servicer import worker_status_pb
from router.placement.prediction import PredictionTracker
from router.serving.serving_metrics import ServingMetrics

STATUS = WorkerStatus(
    worker_id="w0",
    epoch=3,
    running=1,
    waiting=2,
    free_blocks=30,
    total_blocks=40,
    queued_prefill_tokens=96,
    prefix_hit_rate=0.5,
    index_healthy=True,
    waiting_pinned_blocks=7,
    tiers={Tier.HOST: TierFigures(64, 12, 320)},
    adapters=(AdapterInfo("a", "a@1", True, ("t1",)), AdapterInfo("b", "b@2", False)),
)


def predictions() -> PredictionTracker:
    t = PredictionTracker(16)
    t.observe("w0", 64, 64, pulled=True)  # the pull's import was used
    t.observe("w0", 64, 32, pulled=True)  # imported, then evicted before the request ran
    t.observe("w0", 64, 32)  # a miss without a pull: not a pull eviction
    t.observe_pull("w0", 64, 48, seconds=0.3, priced_s=0.1, slow_factor=2.0)
    return t


def test_cluster_status_entry_shows_pinned_blocks_and_pull_evictions() -> None:
    p = predictions().workers["w0"]
    pb = worker_status_pb(STATUS, True, "t2", p)
    assert (pb.worker_id, pb.epoch, pb.alive, pb.kv_usage) == ("w0", 3, True, 0.25)
    assert (pb.queued_prefill_tokens, pb.waiting_pinned_blocks) == (96, 7)
    assert (pb.prediction_placements, pb.prediction_misses) == (3, 2)
    assert (pb.pulls, pb.pulled_tokens, pb.pull_misses, pb.pull_slow) == (1, 48, 1, 1)
    assert pb.pull_evicted == 1
    assert [a.name for a in pb.adapters] == ["b"]  # "a" is t1's only
    bare = worker_status_pb(STATUS, False, None, None)  # no predictions for it yet
    assert (bare.alive, bare.pull_evicted, bare.prediction_placements) == (False, 0, 0)


def test_metrics_gauge_the_blocks_waiting_requests_will_pin() -> None:
    text = ServingMetrics("m").render([STATUS]).decode()
    assert 'kvc_worker_waiting_pinned_blocks{model_name="m",worker="w0"} 7.0' in text
    assert 'kvc_worker_queued_prefill_tokens{model_name="m",worker="w0"} 96.0' in text


def test_tier_figures_reach_the_status_entry_and_tier_labelled_gauges() -> None:
    pb = worker_status_pb(STATUS, True, None, None)
    assert (pb.host_total_blocks, pb.host_cached_blocks, pb.host_hit_tokens) == (64, 12, 320)
    text = ServingMetrics("m").render([STATUS]).decode()
    assert 'kvc_worker_tier_cached_blocks{model_name="m",tier="host",worker="w0"} 12.0' in text
    assert 'kvc_worker_tier_hit_tokens{model_name="m",tier="host",worker="w0"} 320.0' in text
