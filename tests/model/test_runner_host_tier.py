"""ModelRunner's host KV tier: sizing, and batched swaps that move every layer's K and V."""

from __future__ import annotations

import pytest
import torch

from worker.model.runner import KVCacheSizeError, ModelRunner


def _fill(runner: ModelRunner) -> None:
    for layer, (k, v) in enumerate(runner.kv_caches):
        for block in range(runner.num_blocks):
            k[block] = 100 * layer + block
            v[block] = -(100 * layer + block)


def test_host_tier_is_sized_in_whole_blocks_and_off_by_default(model_dirs) -> None:
    path = model_dirs["llama"]
    off = ModelRunner(path, block_size=4, num_blocks=8)
    assert off.num_host_blocks == 0 and off.host_kv_caches == []
    on = ModelRunner(path, block_size=4, num_blocks=8, host_kv_bytes=5 * off.bytes_per_block + 1)
    assert on.num_host_blocks == 5
    assert all(k.shape == (5, *off.kv_caches[0][0].shape[1:]) for k, _ in on.host_kv_caches)
    assert all(k.device.type == "cpu" for k, _ in on.host_kv_caches)
    with pytest.raises(KVCacheSizeError, match="host_kv_bytes"):
        ModelRunner(path, block_size=4, num_blocks=8, host_kv_bytes=-1)


def test_swap_out_then_in_round_trips_every_layer(model_dirs) -> None:
    path = model_dirs["llama"]
    runner = ModelRunner(path, block_size=4, num_blocks=16)
    runner = ModelRunner(
        path, block_size=4, num_blocks=16, host_kv_bytes=4 * runner.bytes_per_block
    )
    _fill(runner)
    runner.swap_out([(3, 0), (9, 2)])
    for layer, (hk, hv) in enumerate(runner.host_kv_caches):
        assert hk[:, 0, 0, 0].tolist()[0] == 100 * layer + 3
        assert hk[2, 0, 0, 0].item() == 100 * layer + 9 and torch.equal(hv[2], -hk[2])
    runner.swap_in([(0, 12), (2, 1)])  # block 3's KV into 12, block 9's into 1
    for layer, (k, v) in enumerate(runner.kv_caches):
        firsts = k[:, 0, 0, 0].tolist()
        expect = [100 * layer + b for b in range(16)]
        expect[12], expect[1] = 100 * layer + 3, 100 * layer + 9
        assert firsts == expect and torch.equal(v, -k)
    with pytest.raises(ValueError, match="out of range"):
        runner.swap_in([(4, 0)])
    with pytest.raises(ValueError, match="out of range"):
        runner.swap_out([(16, 0)])
