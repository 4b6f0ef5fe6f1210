"""Histograms for the per-token series (time to first token, inter-token latency, request
latency): observed on the router's event loop, once per streamed output, and rendered there
(``GET /metrics``).

``prometheus_client``'s own histogram takes a lock per bucket and per sum on every
observation (~2 us, more than the rest of a token's bookkeeping); these series are touched
by one thread only, so a plain count per bucket does
(:class:`~kvstore.requests.histograms.Histogram`). The exposition is the same
(``_bucket{le=...}`` cumulative, ``_count``, ``_sum``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from kvstore.requests.histograms import Histogram


def cumulative(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Per-bucket counts as Prometheus's cumulative ``(le, count)`` pairs, +Inf last."""
    buckets, total = [], 0
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        total += n
        buckets.append((floatToGoString(bound), float(total)))
    return buckets


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
        self._series: dict[tuple[str, ...], Histogram] = {}
        registry.register(self)

    def labels(self, *values: str) -> Histogram:
        assert len(values) == len(self.labelnames), (values, self.labelnames)
        series = self._series.get(values)
        if series is None:
            series = self._series[values] = Histogram(self.bounds)
        return series

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, s in self._series.items():
            fam.add_metric(list(values), cumulative(self.bounds, s.counts), s.sum)
        yield fam
