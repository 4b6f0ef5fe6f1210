"""The router's three choices on a real cluster (local Ray, a real redis-server, two tiny
workers): the real index, fed by the workers' own KV events, answers who holds a prompt;
the loads are the test's (so each regime is certain): an idle holder gets the request, a
saturated holder's prefix is pulled to the other worker (the same tokens as computing it),
a saturated fleet (no room in the other worker's KV) pulls nothing, a tiny prefix is
recomputed; under a load-only policy the hold is priced too. The router actor's start-up
calibration fitted its model."""

from __future__ import annotations

import os
import random
import time
from dataclasses import replace

import pytest
import ray

from cluster.launcher import Cluster
from kvstore.index import KVIndex
from kvstore.requests.protocol import WorkerRequest
from kvstore.requests.sampling_params import SamplingParams
from router import Reason, Router, RouteRequest, RoutingConfig
from router.placement.prefix_source import KVIndexSource
from tests.cluster.conftest import cluster_config
from tests.embedded_ray import shared_ray
from tests.pull.streams import generate
from worker.kv import HashContext

pytestmark = [pytest.mark.ray, pytest.mark.redis]

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
# a slow prefill estimate: the pull's soft deadline (its break-even) is then seconds, so a
# busy test machine cannot make the pulled regime recompute
PULL = {
    "enabled": True,
    "prefill_tokens_per_s": 100.0,
    "min_pull_tokens": 64,
    "source_step_tokens": 256,  # the workers' max_num_batched_tokens
}


@pytest.fixture(scope="module")
def cluster():
    cfg = cluster_config(
        f"pull-{os.getpid()}",
        router={"routing": {"policy": "prefix_affinity", "pull": PULL}},
    )
    shared_ray()  # every cluster of the session on one Ray
    with Cluster(cfg) as c:
        yield c


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def wait_held(index: KVIndex, router: Router, p: list[int], ctx, worker: str, blocks: int) -> None:
    from kvstore.blocks.hashing import block_keys

    keys = block_keys(p, router.block_size, ctx)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if index.lookup(keys).get(worker, 0) >= blocks:
            return
        time.sleep(0.1)
    raise AssertionError(f"{worker} never showed {blocks} blocks in the index")


def held_by_a(cluster, policy: str, seed: int):  # noqa: ANN001, ANN201
    """A router of ``policy`` over the cluster's real index, and a 300-token prompt (18 full
    blocks of prefix) computed on the first worker ``a`` and shown by the index there:
    (a, b, index, router, ctx, heartbeat loads, prompt, its greedy tokens)."""
    a, b = sorted(cluster.workers)
    index = KVIndex(cluster.index_config())
    routing = RoutingConfig(policy=policy, pull=PULL, pending_ttl_s=0)
    router = Router(routing, KVIndexSource(index), block_size=16)
    ctx = HashContext(cluster.model_id)
    loads = {w: info.load for w, info in index.live_workers().items()}
    p = prompt(seed, 300)
    _, want, _ = generate(cluster.workers[a], WorkerRequest(f"s{seed}", p + [9], GREEDY))
    wait_held(index, router, p + [9], ctx, a, 18)
    return a, b, index, router, ctx, loads, p, want


def test_hold_pull_recompute(cluster) -> None:
    a, b, index, router, ctx, loads, p, want = held_by_a(cluster, "prefix_affinity", 1)

    idle = router.route(RouteRequest("r1", p + [7, 8], ctx), loads)  # holder idle
    assert (idle.worker_id, idle.reason, idle.pull) == (a, Reason.PREFIX, None)

    busy = {**loads, a: replace(loads[a], queued_prefill_tokens=50_000)}  # 500 s of queue
    d = router.route(RouteRequest("r2", p + [9], ctx), busy)
    assert d.worker_id == b and d.reason == Reason.PULL and d.pull.source_id == a
    adm, got, cached = generate(
        cluster.workers[b], WorkerRequest("r2", p + [9], GREEDY, pull=d.pull)
    )
    assert adm.pulled.outcome == "ok" and adm.pulled.tokens == 288, adm.pulled
    assert got == want and cached == 288  # pulled, then a prefix hit: the same tokens
    router.pull_reported(d, adm.pulled)
    router.pull_used(d, adm.pulled, cached)
    router.settle(d)
    assert router.planner.ledger.in_flight() == 0
    assert router.planner.ledger.survival(b, 0.0) == 1.0  # used whole

    # the fleet is saturated: b's KV (its heartbeat's free blocks) has no room for the run
    q = prompt(3, 300)  # held by a alone
    generate(cluster.workers[a], WorkerRequest("q0", q + [9], GREEDY))
    wait_held(index, router, q + [9], ctx, a, 18)
    full = {**busy, b: replace(loads[b], free_blocks=10)}
    d = router.route(RouteRequest("r3", q + [6], ctx), full)
    assert (d.worker_id, d.pull) == (b, None) and d.reason != Reason.PULL
    assert router.planner.choices["full"] == 1

    tiny = prompt(2, 40)  # 2 blocks: below min_pull_tokens
    generate(cluster.workers[a], WorkerRequest("t0", tiny, GREEDY))
    wait_held(index, router, tiny, ctx, a, 2)
    d = router.route(RouteRequest("t1", tiny + [5], ctx), busy)
    assert d.worker_id == b and d.pull is None
    for w in cluster.workers.values():
        assert ray.get(w.kv_blocks_in_use.remote(), timeout=30) == 0


def test_router_actor_calibrated_its_transfer_model(cluster) -> None:
    router = next(iter(cluster.routers.values()))

    def pairs(server):  # noqa: ANN001
        planner = server.router.planner
        return {k: (v.fixed_s, v.per_token_s) for k, v in planner.transfers.pairs.items()}

    deadline = time.monotonic() + 60
    fitted = {}
    while time.monotonic() < deadline and not fitted:
        fitted = ray.get(router.__ray_call__.remote(pairs), timeout=30)
        time.sleep(0.5)
    assert len(fitted) == 1, fitted  # one node: one pair
    ((fixed, per_token),) = fitted.values()
    assert fixed >= 0 and per_token > 0


def test_a_load_only_policy_holds_at_an_idle_holder_and_pulls_from_a_saturated_one(
    cluster,
) -> None:
    """least_loaded never looks at prefixes; with pulls on, the planner prices the hold: a
    holder whose short queue ends before recomputing gets the request, a saturated one has
    its prefix pulled to least_loaded's choice (the same tokens)."""
    a, b, _, router, ctx, loads, p, want = held_by_a(cluster, "least_loaded", 4)

    # 1 s of queue on a, none on b: least_loaded picks b, where recomputing takes 3 s
    short = {**loads, a: replace(loads[a], queued_prefill_tokens=100)}
    d = router.route(RouteRequest("l1", p + [7, 8], ctx), short)
    assert (d.worker_id, d.reason, d.pull) == (a, Reason.PREFIX, None)
    assert d.cached_tokens_expected == 288

    busy = {**loads, a: replace(loads[a], queued_prefill_tokens=50_000)}  # 500 s of queue
    d = router.route(RouteRequest("l2", p + [9], ctx), busy)
    assert d.worker_id == b and d.reason == Reason.PULL and d.pull.source_id == a
    adm, got, cached = generate(
        cluster.workers[b], WorkerRequest("l2", p + [9], GREEDY, pull=d.pull)
    )
    assert adm.pulled.outcome == "ok" and got == want and cached == 288
    assert router.planner.choices["hold"] == 1 and router.planner.choices["pull"] == 1
    for w in cluster.workers.values():
        assert ray.get(w.kv_blocks_in_use.remote(), timeout=30) == 0
