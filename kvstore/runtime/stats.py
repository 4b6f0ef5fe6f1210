"""The one quantile rule every report in the project uses (no dependencies)."""

from __future__ import annotations

import math
from collections.abc import Iterable


def quantile(values: Iterable[float], q: float, *, empty: float = math.nan) -> float:
    """Nearest-rank ``q`` quantile of ``values`` (any order): the smallest sample with at
    least ``q`` of the samples at or below it, i.e. the ``ceil(q * n)``-th smallest (the
    first for ``q`` = 0). ``empty`` when there are none. p50 of [1, 2, 3, 4] is 2, p99 of
    100 samples is the 99th smallest."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    ordered = sorted(values)
    if not ordered:
        return empty
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]
