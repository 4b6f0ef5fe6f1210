"""A worker restart with a disk KV tier, through the real parts: the plain worker class (engine
thread, publisher) on the real tiny Llama and one real Redis. The worker serves until blocks
reach its disk, stops as a crash does (no deregistration), and a new incarnation on the same
directory announces the disk's verified blocks under its new epoch before its constructor
returns (before it can take a request); the old epoch's entries are ignored at once and
purged; the first repeat is served from disk with the same greedy tokens. The engine-level
restart (no Redis) is ``tests/engine/test_disk_tier.py``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstore.blocks.tiers import Tier
from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from tests.redis_server import RedisServer
from worker.actor import WorkerServer, WorkerSettings
from worker.engine import EngineConfig, SamplingParams
from worker.kv import block_keys
from worker.kv.disk_tier import DiskTier
from worker.model.build_tiny import build_tiny_model

pytestmark = pytest.mark.redis

BS = 4
BLOCK_BYTES = 2048  # the tiny Llama's KV per block of 4 tokens (2 layers x K,V x 2 x 16 x f32)
WID = "worker-0"
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """6 prefixes of 10 blocks with a distinct tail each: 60 blocks, 1.5x device + host."""
    rng = random.Random(0)
    return [[rng.randrange(2, 200) for _ in range(43)] for _ in range(6)]


def _server(model: str, disk: Path, index: IndexConfig) -> WorkerServer:
    cfg = EngineConfig(
        block_size=BS,
        num_blocks=32,
        host_kv_bytes=8 * BLOCK_BYTES,
        max_model_len=256,
        max_num_seqs=2,
        disk_kv_bytes=1 << 20,
        disk_kv_path=str(disk),
    )
    return WorkerServer(WorkerSettings(WID, model, "m", cfg, index))


def _disk(server: WorkerServer) -> DiskTier:
    tier = server.engine.kv.tiers.get(Tier.DISK)
    assert isinstance(tier, DiskTier)
    return tier


def _serve(server: WorkerServer, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and the prompt tokens the disk tier served for this request."""
    with server.engine_loop.paused() as engine:
        before = engine.metrics().cached_tokens_by_tier().get("disk", 0)
    tokens: list[int] = []
    for out in server.engine_loop.add_request(prompt, GREEDY):
        assert out.error is None, out.error
        tokens += [t for d in out.outputs for t in d.token_ids]
    with server.engine_loop.paused() as engine:
        # the request's own disk tokens: cached prompt tokens by source tier, as exported
        disk = engine.metrics().cached_tokens_by_tier().get("disk", 0) - before
        assert _disk(server).disk.drain(10)  # its evictions' writes have landed
    return tokens, disk


def _stop(server: WorkerServer, *, deregister: bool) -> None:
    server.engine_loop.stop()
    assert server.index.publisher is not None
    server.index.publisher.stop(deregister=deregister)
    server.telemetry.stop_heartbeat()
    _disk(server).disk.close()


def test_a_restarted_worker_announces_its_disk_under_its_new_epoch_before_serving(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    model = str(build_tiny_model(None, "llama", "tiny"))
    cfg = IndexConfig(url=redis_server.url, model_id="m", heartbeat_ttl_s=5.0)
    index = KVIndex(cfg)
    ns, client = cfg.namespace, index.client
    prompts = _prompts()
    first = _server(model, tmp_path, cfg)
    try:
        cold = [_serve(first, p)[0] for p in prompts]  # an empty cache: computed
        assert first.index.publisher is not None and first.index.publisher.flush()
        old_epoch = first.index.epoch
        old_slot = client.hget(ns + "reg", WID).decode().split(":")[0]
        assert client.hget(ns + "slots", old_slot) == f"{old_epoch}:{WID}".encode()
        old_device = index.held_keys(WID, Tier.DEVICE)
        assert old_device and _disk(first).stats().written_blocks > 0
    finally:
        _stop(first, deregister=False)  # a crash: the old registration stays in Redis

    again = _server(model, tmp_path, cfg)  # a new process on the same directory
    try:
        # its constructor returned: the index already lists the disk's verified blocks
        with again.engine_loop.paused():
            on_disk = set(_disk(again).keys())
        assert again.index.epoch is not None and again.index.epoch > old_epoch
        assert len(on_disk) >= 10  # at least a whole prompt's blocks (none of the last's)
        assert index.held_keys(WID, Tier.DISK) == on_disk
        assert index.live_workers()[WID].epoch == again.index.epoch
        # the old epoch's entries are ignored at once: nothing of its device is credited
        last = block_keys(prompts[-1], BS, again.engine.hash_context(GREEDY))
        assert set(last) & old_device
        assert index.lookup_tiers(last).get(WID, {}).get(Tier.DEVICE, 0) == 0
        assert index.held_keys(WID, Tier.DEVICE).isdisjoint(old_device)
        # ... and purged (as every publisher does every 10 s; this one may have already)
        index.purge_dead()
        assert f"{old_epoch}:{WID}".encode() not in client.hvals(ns + "slots")
        assert not list(client.scan_iter(f"{ns}held:*:{old_slot}"))
        assert index.held_keys(WID, Tier.DISK) == on_disk  # the new epoch's stay
        # the first request repeats the oldest prompt: most of it from disk, the cold tokens
        tokens, from_disk = _serve(again, prompts[0])
        assert from_disk >= 8 * BS and tokens == cold[0]
    finally:
        _stop(again, deregister=True)
        index.close()
