"""Fleet-aware eviction through the real parts: two workers (the plain actor class, engine
threads and publishers) on one real Redis. A prefix both hold is a spare on the worker whose
registry slot is higher; that worker, out of blocks, evicts it before an older prefix it is
the fleet's only holder of (plain LRU would evict the older one)."""

from __future__ import annotations

import random
import time

import pytest

from kvstore.config import IndexConfig
from worker.actor import WorkerServer, WorkerSettings
from worker.engine import EngineConfig, SamplingParams
from worker.kv import block_keys
from worker.model.build_tiny import build_tiny_model

pytestmark = pytest.mark.redis

BS = 16
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(server: WorkerServer, p: list[int]) -> None:
    stream = server.engine_loop.add_request(p, ONE)
    assert stream is not None
    assert len([out for out in stream]) >= 1


def held(server: WorkerServer, p: list[int]) -> int:
    def hit(e) -> int:  # noqa: ANN001
        ctx = e.hash_context(ONE)
        return e.kv.lookup_prefix(p, ctx, block_keys(p, BS, ctx)).num_tokens

    with server.engine_loop.paused() as engine:
        return hit(engine)


def spares(server: WorkerServer) -> int:
    with server.engine_loop.paused() as e:
        return sum(b.pulled for b in e.kv.pool.cached.values())


def test_a_duplicate_is_evicted_before_the_fleets_last_copy(redis_server) -> None:  # noqa: ANN001
    model = str(build_tiny_model(None, "llama", "tiny"))
    index = IndexConfig(url=redis_server.url, model_id="m", heartbeat_ttl_s=2.0)
    servers = []
    for wid in ("worker-0", "worker-1"):  # registered in this order: slots 0 and 1
        cfg = EngineConfig(block_size=BS, num_blocks=10, max_model_len=256)
        servers.append(WorkerServer(WorkerSettings(wid, model, "m", cfg, index)))
        assert servers[-1].index.publisher is not None and servers[-1].index.publisher.flush()
    keeper, copy = servers
    mine, shared, new = prompt(1, 70), prompt(2, 70), prompt(3, 60)
    try:
        run(keeper, shared)  # worker-0 keeps the shared prefix
        assert keeper.index.publisher.flush()
        run(copy, mine)  # worker-1's own prefix: older, the fleet's last copy
        run(copy, shared)  # then the duplicate, more recent
        deadline = time.monotonic() + 10
        while spares(copy) != 4:  # the index named the 4 shared blocks
            assert time.monotonic() < deadline, "the spares never reached the pool"
            run(copy, shared)  # steps wake the publisher's rounds
        assert spares(keeper) == 0
        run(copy, new)  # 4 blocks: the 2 free uncached ones, then 2 evicted
        assert held(copy, mine) == 64  # the last copy stays whole
        assert held(copy, shared) == 32  # the duplicate lost its tail
        assert held(keeper, shared) == 64
        with copy.engine_loop.paused() as engine:
            engine.kv.check_invariants()
    finally:
        for s in servers:
            s.engine_loop.stop()
            s.index.stop()
            s.telemetry.stop_heartbeat()
