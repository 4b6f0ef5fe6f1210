"""The CPU linear layer: oneDNN's batches are padded to a bounded set of row counts (oneDNN
keeps state per row count it has seen: unpadded, a serving worker's memory grew with every
new batch shape), and the padded result is the plain product's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.layers import ONEDNN_MIN_WEIGHT, linear, onednn_rows


def test_row_counts_are_padded_to_few_sizes_never_fewer_rows() -> None:
    rows = [onednn_rows(m) for m in range(1, 4097)]
    assert rows[:16] == list(range(1, 17))  # exact to 16 rows
    assert all(m <= r <= m * 9 // 8 + 1 for m, r in enumerate(rows, 1))
    assert len(set(rows)) <= 16 + 8 * 8  # 8 sizes per doubling from 16 to 4096


@pytest.mark.parametrize("m", [1, 2, 3, 5, 9, 17, 33, 63, 65, 130])
def test_padded_products_equal_the_plain_ones(m: int) -> None:
    torch.manual_seed(m)
    weight = torch.randn(ONEDNN_MIN_WEIGHT // 256 + 7, 256)  # large: oneDNN from 2 rows
    bias = torch.randn(weight.shape[0])
    x = torch.randn(m, 256)
    with torch.no_grad():
        got = linear(x, weight, bias)
    assert got.shape == (m, weight.shape[0])
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
