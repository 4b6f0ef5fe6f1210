"""The project's one quantile rule."""

from __future__ import annotations

import math

import pytest

from kvstore.runtime.stats import quantile


def test_nearest_rank() -> None:
    assert quantile([4, 1, 3, 2], 0.5) == 2  # any order; ceil(0.5 * 4) = 2nd smallest
    assert quantile(range(1, 101), 0.99) == 99
    assert quantile(range(1, 101), 0.991) == 100
    assert quantile([5.0], 0.0) == quantile([5.0], 1.0) == 5.0
    assert quantile([3, 1, 2], 0.0) == 1 and quantile([3, 1, 2], 1.0) == 3
    assert math.isnan(quantile([], 0.5)) and quantile([], 0.5, empty=0.0) == 0.0
    with pytest.raises(ValueError, match="1.5"):
        quantile([1.0], 1.5)
