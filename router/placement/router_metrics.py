"""In-process router metrics: plain counters and a latency histogram (exported elsewhere)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvstore.runtime.stats import quantile
from router.placement.placement_types import Reason, RouteDecision


class LatencyHistogram:
    """Count, sum and the most recent ``window`` samples (for p50/p99)."""

    def __init__(self, window: int = 100_000) -> None:
        self.count = 0
        self.total_s = 0.0
        self._recent: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self._recent.append(seconds)

    def latest(self, n: int) -> list[float]:
        """The ``n`` most recent samples (fewer if the window holds fewer), oldest first."""
        if n <= 0:
            return []
        k = min(n, len(self._recent))
        return [self._recent[i] for i in range(len(self._recent) - k, len(self._recent))]

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile of the recent window (0.0 when empty)."""
        return quantile(self._recent, q, empty=0.0)


@dataclass
class RouterMetrics:
    """What one router has done; ``snapshot()`` is the export format."""

    decisions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (policy, reason)
    placed: Counter[str] = field(default_factory=Counter)  # placements per worker (attempts)
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # decision latency
    index_errors: int = 0  # prefix lookups that raised (routed by load instead)
    index_skipped: int = 0  # prefix lookups not tried: the index circuit was open (by load)
    pending_assists: int = 0  # decisions where pending placements knew more than the index
    parity_checks: int = 0  # keys compared with what the chosen worker stored
    parity_mismatches: int = 0  # of those, different keys: the router hashes differently!

    def observe(self, decision: RouteDecision) -> None:
        self.decisions[(decision.policy, str(decision.reason))] += 1
        self.placed[decision.worker_id] += 1
        self.latency.observe(decision.decision_latency_s)

    def count(self, reason: Reason, policy: str | None = None) -> int:
        return sum(n for (p, r), n in self.decisions.items() if r == reason and policy in (None, p))

    def snapshot(self) -> dict[str, float | int | dict[str, int]]:
        return {
            "decisions": {f"{p}/{r}": n for (p, r), n in sorted(self.decisions.items())},
            "placed": dict(self.placed),
            "decision_latency_p50_s": self.latency.quantile(0.50),
            "decision_latency_p99_s": self.latency.quantile(0.99),
            "decision_latency_mean_s": self.latency.total_s / max(1, self.latency.count),
            "index_errors": self.index_errors,
            "index_skipped": self.index_skipped,
            "pending_assists": self.pending_assists,
            "parity_checks": self.parity_checks,
            "parity_mismatches": self.parity_mismatches,
        }
