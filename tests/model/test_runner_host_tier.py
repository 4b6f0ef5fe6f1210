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
    with pytest.raises(ValueError, match="appears twice"):
        runner.swap_in([(0, 5), (2, 5)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_overlapped_copies_on_cuda_see_and_leave_the_right_blocks(model_dirs) -> None:
    """Offload DMAs and load DMAs run on a side stream: blocks handed out again right after an
    offload may be overwritten at once, a load of a block whose offload is still in flight
    gets its offloaded contents, and loaded blocks equal their sources for later kernels."""
    path = model_dirs["llama"]
    probe = ModelRunner(path, block_size=4, num_blocks=8)
    runner = ModelRunner(
        path,
        device="cuda",
        dtype="bfloat16",
        block_size=4,
        num_blocks=256,
        host_kv_bytes=256 * probe.bytes_per_block,
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen, device="cuda"))
        v.copy_(torch.randn(v.shape, generator=gen, device="cuda"))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    torch.cuda.synchronize()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):  # queue compute so the side stream's copies really overlap it
        busy = busy @ busy / 64
    src = list(range(0, 200, 2))  # 100 blocks out to host blocks 100..199
    runner.swap_out([(d, 100 + i) for i, d in enumerate(src)])
    for k, v in runner.kv_caches:  # the device reuses the offloaded blocks at once
        k[src] = 0
        v[src] = 0
    dst = [201 + (i % 55) for i in range(55)]  # load half of them back while still in flight
    runner.swap_in([(100 + i, d) for i, d in zip(range(55), dst, strict=True)])
    after = [(k.clone(), v.clone()) for k, v in runner.kv_caches]  # compute stream, in order
    for (k0, v0), (k1, v1) in zip(before, after, strict=True):
        assert torch.equal(k1[dst], k0[src[:55]]) and torch.equal(v1[dst], v0[src[:55]])
        assert not k1[src].any() and not v1[src].any()
    for (k0, v0), (hk, hv) in zip(before, runner.host_kv_caches, strict=True):  # flushes
        assert torch.equal(hk[100:200], k0[src].cpu()) and torch.equal(hv[100:200], v0[src].cpu())
    back = list(range(0, 20, 2))  # a load from landed host blocks, into zeroed blocks
    runner.swap_in([(160 + i, d) for i, d in enumerate(back)])
    for (k0, v0), (k, v) in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(k[back], k0[src[60:70]]) and torch.equal(v[back], v0[src[60:70]])
