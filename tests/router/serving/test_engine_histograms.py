"""The histograms and wait reasons a worker's status carries reach a router's /metrics
under vLLM's names, per worker; router.log_stats off leaves the per-output series alone."""

from __future__ import annotations

import pickle
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from kvstore.requests.histograms import Histogram
from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from kvstore.requests.protocol import WAIT_REASONS
from router.serving.serving_metrics import ENGINE_HISTOGRAMS, ServingMetrics
from tests.engine.fakes import FakeExecutor
from tests.router.serving.test_status_surfaces import STATUS
from worker.engine import Engine, EngineConfig


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    }


def test_every_engine_histogram_has_a_router_name() -> None:
    engine = Engine(FakeExecutor(16, 4), EngineConfig(block_size=4, max_model_len=32))
    assert set(engine.snapshot().histograms) == set(ENGINE_HISTOGRAMS)


def test_a_status_histogram_renders_cumulative_under_vllms_name() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.7, 3.0):
        h.observe(v)
    status = replace(
        STATUS,
        histograms={"request_queue_time": h.counts_now(), "from_a_newer_worker": h.counts_now()},
        waiting_by_reason={"kv_blocks": 2, "new": 1},
    )
    status = pickle.loads(pickle.dumps(status))  # as it crosses from the worker
    got = _samples(ServingMetrics("m").render([status]))
    w0 = (("model_name", "m"), ("worker", "w0"))
    name = "vllm:request_queue_time_seconds"
    buckets = {
        le: got[(f"{name}_bucket", tuple(sorted((*w0, ("le", le)))))]
        for le in ("0.1", "1.0", "+Inf")
    }
    assert buckets == {"0.1": 1.0, "1.0": 3.0, "+Inf": 4.0}
    assert got[(f"{name}_count", w0)] == 4.0 and abs(got[(f"{name}_sum", w0)] - 4.25) < 1e-9
    assert not any("from_a_newer_worker" in k[0] for k in got)
    reason = "kvc_worker_requests_waiting_by_reason"
    waiting = {dict(k[1])["reason"]: v for k, v in got.items() if k[0] == reason}
    assert waiting == {**dict.fromkeys(WAIT_REASONS, 0.0), "kv_blocks": 2.0, "new": 1.0}


def test_log_stats_off_times_no_output() -> None:
    end = CompletionDelta(0, "c", [3], finish_reason=FinishReason.LENGTH)
    for on in (True, False):
        m = ServingMetrics("m", log_stats=on)
        m.tracker().output("w0", RequestOutput("r", [end], True, Usage(4, 0, 1)))
        got = _samples(m.render([]))
        ttft = got.get(
            ("vllm:time_to_first_token_seconds_count", (("model_name", "m"), ("worker", "w0")))
        )
        assert ttft == (1.0 if on else None)
