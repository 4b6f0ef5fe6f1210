"""Histograms for the per-token series (time to first token, inter-token latency, request
latency): observed on the router's event loop, once per streamed output, and rendered there
(``GET /metrics``).

``prometheus_client``'s own histogram takes a lock per bucket and per sum on every
observation (~2 us, more than the rest of a token's bookkeeping); these series are touched
by one thread only, so a plain count per bucket does. The exposition is the same
(``_bucket{le=...}`` cumulative, ``_count``, ``_sum``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class Series:
    """One labelled series: counts per bucket (the last one: above every bound) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """``value`` observed ``times`` times (a message of k tokens: k equal gaps)."""
        self.counts[bisect_left(self.bounds, value)] += times  # le: value <= bound
        self.sum += value * times


class LoopHistogram(Collector):
    """A histogram family whose series are observed and collected on one thread."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.bounds = tuple(sorted(buckets))
        self._series: dict[tuple[str, ...], Series] = {}
        registry.register(self)

    def labels(self, *values: str) -> Series:
        assert len(values) == len(self.labelnames), (values, self.labelnames)
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = Series(self.bounds)
        return series

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, s in self._series.items():
            buckets, total = [], 0
            for bound, n in zip((*self.bounds, float("inf")), s.counts, strict=True):
                total += n
                buckets.append((floatToGoString(bound), float(total)))
            fam.add_metric(list(values), buckets, s.sum)
        yield fam
