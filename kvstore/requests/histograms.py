"""Histograms as plain bucket counts: observed by one thread (the router's event loop, a
worker's engine thread) without a lock, and carried between processes as counts.

:class:`Histogram` is the running form (a count per bucket, the last one above every bound,
and the sum); :class:`HistogramCounts` is its frozen copy, what a worker's status carries to
the routers, which render it in Prometheus's form (``_bucket{le=...}`` cumulative,
``_count``, ``_sum``). ``prometheus_client``'s own histogram takes a lock per observation
(~2 us), more than the rest of a token's bookkeeping on the router.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from kvstore.requests.wire import ByName


@dataclass(frozen=True, slots=True)
class HistogramCounts(ByName):
    """One histogram's counts at a moment."""

    bounds: tuple[float, ...]  # upper bounds of the buckets, ascending (le)
    counts: tuple[int, ...]  # observations per bucket; one more than bounds (the +Inf one)
    sum: float = 0.0  # of every observed value

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram:
    """Counts per bucket and the sum, mutated by one thread; :meth:`counts_now` copies."""

    __slots__ = ("bounds", "counts", "sum", "_frozen")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        assert list(bounds) == sorted(bounds), bounds
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self._frozen: HistogramCounts | None = None  # the last copy, until an observation

    def observe(self, value: float, times: int = 1) -> None:
        """``value`` observed ``times`` times (a message of k tokens: k equal gaps)."""
        self.counts[bisect_left(self.bounds, value)] += times  # le: value <= bound
        self.sum += value * times
        self._frozen = None

    def counts_now(self) -> HistogramCounts:
        """A frozen copy, reused while nothing was observed (a snapshot after every step
        copies nothing when no request finished)."""
        frozen = self._frozen
        if frozen is None:
            frozen = self._frozen = HistogramCounts(self.bounds, tuple(self.counts), self.sum)
        return frozen
