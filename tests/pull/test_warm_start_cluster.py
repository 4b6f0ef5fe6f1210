"""Warm start by itself, on a real cluster (local Ray, redis-server, a router with pulls on):
a worker added to a warm fleet, and a worker Ray restarted, each end up holding the fleet's
hot prefix — in their engine and in the index — before any request was sent to them; the
first request they get is a prefix hit with the tokens the fleet computes. The cold prefix
is not pulled (the budget is one prefix), and nothing is left pinned."""

from __future__ import annotations

import os
import random
import time

import pytest
import ray

from cluster.launcher import Cluster
from kvstore.blocks.hashing import HashContext, block_keys
from kvstore.blocks.protocol import WorkerRequest
from kvstore.blocks.sampling_params import SamplingParams
from kvstore.index import KVIndex
from kvstore.types import IndexUnavailable
from tests.cluster.conftest import cluster_config
from tests.embedded_ray import shared_ray
from tests.pull.streams import generate as generate_one

pytestmark = [pytest.mark.ray, pytest.mark.redis]

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PULL = {"enabled": True, "warm_start_prefixes": 1, "warm_start_share": 0.5}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def generate(handle, req: WorkerRequest) -> tuple[list[int], int]:
    _, toks, cached = generate_one(handle, req)
    return toks, cached


def wait_for(pred, timeout_s: float = 60.0) -> bool:
    """Until ``pred()``; an actor Ray is still restarting, or a Redis read that timed out on a
    busy machine, is "not yet", not a failure (the next poll asks again)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pred():
                return True
        except (ray.exceptions.ActorUnavailableError, IndexUnavailable):
            pass
        time.sleep(0.2)
    return False


def test_added_and_restarted_workers_warm_start_from_the_fleet() -> None:
    cfg = cluster_config(
        f"warm-{os.getpid()}",
        workers={"max_restarts": 1},
        router={"routing": {"policy": "least_loaded", "pull": PULL}},
    )
    shared_ray()  # every cluster of the session on one Ray
    with Cluster(cfg) as cluster:
        index = KVIndex(cluster.index_config())
        ctx = HashContext(cluster.model_id)
        hot, cold = tokens(1, 160), tokens(2, 160)  # 10 full blocks each
        keys = block_keys(hot, BS, ctx)[:10]
        w0, w1 = (cluster.workers[w] for w in sorted(cluster.workers))
        want = None
        for i in range(3):  # the hot system prompt, three questions, on both workers
            for j, w in enumerate((w0, w1)):
                out, _ = generate(w, WorkerRequest(f"h{i}{j}", hot + [7 + i, 9], GREEDY))
                want = out if i == 0 and j == 0 else want
        generate(w0, WorkerRequest("c", cold + [7, 9], GREEDY))  # served once: not hot

        added = cluster.add_worker()
        new = cluster.workers[added]
        assert wait_for(lambda: index.lookup(keys).get(added, 0) == 10)
        stats = ray.get(new.pull_stats.remote())
        assert stats["warm_started"] and stats["warmed_blocks"] == 10, stats
        assert ray.get(new.kv_blocks_in_use.remote()) == 0
        assert index.lookup(block_keys(cold, BS, ctx)[:10]).get(added, 0) == 0
        out, cached = generate(new, WorkerRequest("first", hot + [7, 9], GREEDY))
        assert cached == 160 and out == want

        # a worker Ray restarts is a new incarnation: it warms up again, from its peers
        epoch = index.live_workers()["worker-1"].epoch
        ray.kill(w1, no_restart=False)
        assert wait_for(
            lambda: getattr(index.live_workers().get("worker-1"), "epoch", -1) > epoch, 90
        )
        assert wait_for(lambda: ray.get(w1.pull_stats.remote())["warm_started"], 60)
        assert ray.get(w1.pull_stats.remote())["warmed_blocks"] == 10
        out, cached = generate(w1, WorkerRequest("again", hot + [8, 9], GREEDY))
        assert cached == 160
        results = ray.get(cluster.routers["router-0"].warm_start_results.remote())
        assert results[added]["blocks"] == 10 and results["worker-1"]["blocks"] == 10
