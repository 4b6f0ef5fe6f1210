"""Predicted vs realised prefix hits, per worker: is the index telling the truth?

For every placement the router made with an index answer it knows how many prompt tokens
it *predicted* the chosen worker would serve from cache; the worker's first output reports
how many it *realised*. A gap of a block or more is a *miss*. Misses happen now and then
(an eviction between lookup and admission, a burst the pending placements did not cover),
but a worker whose predictions keep missing has index entries that are wrong — stale or
lost entries, a missed event, a hash mismatch — and every later placement on it is made on
bad data. Placements that carried a peer pull add a pulled column: the tokens the pull
was priced for and those it imported, and the pulls that missed (imported less) or were
slower than priced. :class:`PredictionTracker` counts both totals per worker, keeps a window of
recent gaps, and says when a worker's entries should be rebuilt from its pool (a resync).
Plain Python: the serving core feeds it from the event loop and acts on its verdicts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

GAP_BUCKETS_TOKENS = [0, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384]


@dataclass
class WorkerPredictions:
    """What one router predicted and what one worker realised."""

    placements: int = 0  # placements compared
    predicted_tokens: int = 0  # cached tokens predicted, summed
    realised_tokens: int = 0  # cached tokens realised, summed
    misses: int = 0  # placements whose |gap| was at least ``miss_tokens``
    resyncs: int = 0  # resyncs this router asked the worker for
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=64))  # signed gaps
    last_resync: float | None = None  # clock time of the last resync asked
    pulls: int = 0  # placements that carried a pull from a peer
    pull_planned_tokens: int = 0  # tokens those pulls were priced for, summed
    pulled_tokens: int = 0  # tokens they imported, summed
    pull_misses: int = 0  # pulls that imported less than planned (recomputed the rest)
    pull_slow: int = 0  # pulls that took longer than slow_factor x their priced time
    # placements whose pull imported but whose realised hit still fell a block short of
    # the prediction (the import, or the blocks before it, evicted before the request ran)
    pull_evicted: int = 0
    pull_priced_s: float = 0.0  # the time those pulls were priced at, summed
    pull_s: float = 0.0  # the time they took, summed

    def mean_abs_gap(self) -> float:
        return sum(abs(g) for g in self.recent) / len(self.recent) if self.recent else 0.0


@dataclass(frozen=True, slots=True)
class ResyncVerdict:
    """Ask ``worker_id`` to resync its index entries, and why (for the log)."""

    worker_id: str
    reason: str


class PredictionTracker:
    """Per-worker prediction accounting and the resync rule.

    A worker is resynced when at least ``min_misses`` of its last ``window`` placements
    missed (a persistent gap, not one unlucky eviction), and no resync was asked for it in
    the last ``cooldown_s`` (a resync takes a moment to land; its effect must be observed
    before asking again). After a verdict the worker's window starts empty, so the next one
    needs fresh evidence. ``miss_tokens``: the smallest gap counted as a miss, one block at
    the index's granularity (``block_size x record_every``).
    """

    def __init__(
        self,
        miss_tokens: int,
        *,
        window: int = 4,
        min_misses: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if miss_tokens < 1:
            raise ValueError(f"miss_tokens must be >= 1, got {miss_tokens}")
        if not 1 <= min_misses <= window:
            raise ValueError(f"need 1 <= min_misses ({min_misses}) <= window ({window})")
        self.miss_tokens = miss_tokens
        self.window = window
        self.min_misses = min_misses
        self.cooldown_s = cooldown_s
        self._clock = clock
        self.workers: dict[str, WorkerPredictions] = {}
        self._streak: dict[str, deque[bool]] = {}  # worker -> last `window` miss flags

    def observe(
        self, worker_id: str, predicted: int, realised: int, *, pulled: bool = False
    ) -> ResyncVerdict | None:
        """Record one placement (``pulled``: its pull imported blocks); a verdict when the
        worker's entries should be rebuilt."""
        w = self.workers.setdefault(worker_id, WorkerPredictions())
        gap = predicted - realised
        miss = abs(gap) >= self.miss_tokens
        w.pull_evicted += pulled and gap >= self.miss_tokens
        w.placements += 1
        w.predicted_tokens += predicted
        w.realised_tokens += realised
        w.misses += miss
        w.recent.append(gap)
        streak = self._streak.setdefault(worker_id, deque(maxlen=self.window))
        streak.append(miss)
        if sum(streak) < self.min_misses:
            return None
        now = self._clock()
        if w.last_resync is not None and now - w.last_resync < self.cooldown_s:
            return None
        gaps = list(w.recent)[-len(streak) :]
        streak.clear()
        w.resyncs += 1
        w.last_resync = now
        over = sum(g > 0 for g in gaps)
        kind = (
            "the index claims blocks the worker does not hold (stale entries)"
            if over * 2 > len(gaps)
            else "the worker holds blocks the index does not show (lost entries)"
        )
        return ResyncVerdict(
            worker_id,
            f"{self.min_misses}+ of its last {len(gaps)} placements missed the predicted "
            f"cached tokens by a block or more (gaps predicted-realised: {gaps} tokens): "
            f"{kind}",
        )

    def observe_pull(
        self,
        worker_id: str,
        planned_tokens: int,
        pulled_tokens: int,
        seconds: float,
        priced_s: float,
        slow_factor: float,
    ) -> None:
        """Record one placement's pull: planned vs imported tokens, priced vs taken time."""
        w = self.workers.setdefault(worker_id, WorkerPredictions())
        w.pulls += 1
        w.pull_planned_tokens += planned_tokens
        w.pulled_tokens += pulled_tokens
        w.pull_misses += pulled_tokens < planned_tokens
        w.pull_slow += seconds > slow_factor * priced_s
        w.pull_priced_s += priced_s
        w.pull_s += seconds

    def totals(self) -> dict[str, int]:
        ws = self.workers.values()
        return {
            "prediction_placements": sum(w.placements for w in ws),
            "prediction_misses": sum(w.misses for w in ws),
            "prediction_resyncs": sum(w.resyncs for w in ws),
        }

    def pull_totals(self) -> dict[str, int]:
        """The pulled column, summed over workers (priced and taken times in ms)."""
        ws = self.workers.values()
        return {
            "pulls": sum(w.pulls for w in ws),
            "pulled_tokens": sum(w.pulled_tokens for w in ws),
            "pull_misses": sum(w.pull_misses for w in ws),
            "pull_slow": sum(w.pull_slow for w in ws),
            "pull_evicted": sum(w.pull_evicted for w in ws),
            "pull_time_priced_ms": round(1e3 * sum(w.pull_priced_s for w in ws)),
            "pull_time_taken_ms": round(1e3 * sum(w.pull_s for w in ws)),
        }
