"""The router's per-token histograms (lock-free, one thread) render exactly as
prometheus_client's own histogram does for the same observations, and a message of k
tokens counts k inter-token gaps."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvstore.requests.outputs import CompletionDelta, RequestOutput, Usage
from router.serving.loop_histograms import LoopHistogram
from router.serving.serving_metrics import ServingMetrics

BUCKETS = (0.01, 0.05, 0.1, 1.0)
VALUES = [0.0, 0.01, 0.010001, 0.05, 0.07, 0.5, 1.0, 3.0, 0.02]


def _samples(text: bytes) -> list[str]:
    # (prometheus_client's own histogram adds _created series; the loop one has none)
    return [ln for ln in text.decode().splitlines() if "_created" not in ln]


def test_loop_histogram_renders_as_prometheus_clients_histogram() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    h = Histogram("lat_seconds", "Latency.", ("worker",), buckets=BUCKETS, registry=theirs)
    mine = LoopHistogram("lat_seconds", "Latency.", ("worker",), BUCKETS, ours)
    for w in ("w0", "w1"):
        for v in VALUES if w == "w0" else VALUES[:3]:
            h.labels(w).observe(v)
            mine.labels(w).observe(v)
    mine.labels("w2").observe(0.07, 3)  # three equal gaps at once
    for _ in range(3):
        h.labels("w2").observe(0.07)
    assert _samples(generate_latest(ours)) == _samples(generate_latest(theirs))


def test_a_coalesced_message_counts_one_gap_per_token() -> None:
    m = ServingMetrics("model")
    timer = m.tracker()

    def out(k: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", [CompletionDelta(0, "", [1] * k)], finished, Usage(4, 0, 1))

    timer.output("w0", out(1))  # the first token: time to first token, no gap
    timer.output("w0", out(3))  # three tokens in one message: three gaps
    timer.output("w0", out(2, finished=True))
    itl = m.itl.labels("model", "w0")
    assert sum(itl.counts) == 5 and sum(m.ttft.labels("model", "w0").counts) == 1
    assert sum(m.e2e.labels("model", "w0").counts) == 1
