"""PredictionTracker: per-worker totals, misses at a block of gap either way, a resync verdict
only for persistent misses, one per cooldown, and fresh evidence needed after a verdict."""

from __future__ import annotations

import pytest

from router.placement.prediction import PredictionTracker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_totals_and_misses_either_way() -> None:
    t = PredictionTracker(16, clock=Clock())
    assert t.observe("w0", 64, 64) is None  # exact
    assert t.observe("w0", 64, 56) is None  # under a block: not a miss
    assert t.observe("w1", 64, 0) is None  # stale: predicted more
    assert t.observe("w1", 0, 32) is None  # lost: realised more
    w0, w1 = t.workers["w0"], t.workers["w1"]
    assert (w0.placements, w0.predicted_tokens, w0.realised_tokens, w0.misses) == (2, 128, 120, 0)
    assert (w1.placements, w1.misses, list(w1.recent)) == (2, 2, [64, -32])
    assert w1.mean_abs_gap() == 48.0
    assert t.totals() == {
        "prediction_placements": 4,
        "prediction_misses": 2,
        "prediction_resyncs": 0,
    }


def test_persistent_misses_trigger_one_resync_per_cooldown() -> None:
    clock = Clock()
    t = PredictionTracker(16, window=4, min_misses=3, cooldown_s=5.0, clock=clock)
    assert t.observe("w0", 80, 0) is None
    assert t.observe("w0", 80, 80) is None  # one good placement in between
    assert t.observe("w0", 80, 0) is None
    verdict = t.observe("w0", 80, 0)  # 3 of the last 4 missed
    assert verdict is not None and verdict.worker_id == "w0"
    assert "stale entries" in verdict.reason and "[80, 0, 80, 80]" in verdict.reason
    assert t.workers["w0"].resyncs == 1
    # fresh evidence needed, and the cooldown holds even with it
    for _ in range(3):
        assert t.observe("w0", 80, 0) is None
    clock.now = 5.0
    verdict = t.observe("w0", 0, 64)
    assert verdict is not None and "[80, 80, 80, -64]" in verdict.reason
    assert t.workers["w0"].resyncs == 2
    # workers are judged separately; realised above predicted: lost entries
    assert t.observe("w1", 0, 64) is None and t.observe("w1", 0, 64) is None
    verdict = t.observe("w1", 16, 80)
    assert verdict is not None and verdict.worker_id == "w1"
    assert "lost entries" in verdict.reason


def test_occasional_misses_never_trigger() -> None:
    t = PredictionTracker(16, window=4, min_misses=3, clock=Clock())
    for i in range(100):
        miss = i % 3 == 0  # one in three: never 3 of any 4 consecutive
        assert t.observe("w0", 64, 0 if miss else 64) is None
    assert t.workers["w0"].misses == 34 and t.workers["w0"].resyncs == 0


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="miss_tokens"):
        PredictionTracker(0)
    with pytest.raises(ValueError, match="min_misses"):
        PredictionTracker(16, window=2, min_misses=3)
