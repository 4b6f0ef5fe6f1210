"""Tenants and adapters never cross in a pull, on a real cluster (local Ray, redis-server,
two workers serving two LoRA adapters, pulls on): a prefix worker-0 computed for adapter x
is pulled by worker-1 for a request of adapter x (a prefix hit, the tokens worker-0 gives),
and for nobody else — the base model, adapter y, and adapter x under another tenant's salt
all find nothing to import and recompute, with the tokens they give when nothing is pulled.
A worker added to the fleet warms up the adapter's prefix, and it serves only the adapter."""

from __future__ import annotations

import os
import random
import time
from dataclasses import replace

import pytest
import ray

from cluster.launcher import Cluster
from kvstore.requests.protocol import PullHint, WorkerRequest
from kvstore.requests.sampling_params import SamplingParams
from tests.cluster.conftest import ENGINE, cluster_config
from tests.embedded_ray import shared_ray
from tests.pull.streams import generate
from worker.model.build_tiny_lora import build_tiny_lora
from worker.model.default_model import resolve_default_model

pytestmark = [pytest.mark.ray, pytest.mark.redis]

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
X, Y = replace(GREEDY, lora="x"), replace(GREEDY, lora="y")
PROMPT = [random.Random(5).randrange(3, 500) for _ in range(90)]  # 5 full blocks (+ 10)
HINT = PullHint("worker-0", 0, 5, deadline_s=30.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    root = tmp_path_factory.mktemp("pull-loras")
    base = resolve_default_model("llama")
    paths = {n: str(build_tiny_lora(root / n, base, rank=4, seed=s)) for s, n in enumerate("xy")}
    cfg = cluster_config(
        f"pulliso-{os.getpid()}",
        workers={"engine": {**ENGINE, "lora_adapters": paths}},
        router={"routing": {"pull": {"enabled": True, "warm_start_prefixes": 1}}},
    )
    shared_ray()  # every cluster of the session on one Ray
    with Cluster(cfg) as c:
        yield c


def test_an_adapters_prefix_is_pulled_for_that_adapter_only(cluster) -> None:
    a, b = cluster.workers["worker-0"], cluster.workers["worker-1"]
    _, want_x, _ = generate(a, WorkerRequest("ax", PROMPT, X))
    _, again, cached = generate(a, WorkerRequest("ax2", PROMPT, X))  # hot on worker-0
    assert cached == 80 and again == want_x
    salted = replace(X, cache_salt="tenant-2")
    others = (("base", GREEDY), ("y", Y), ("x-salted", salted))
    got = {}
    for name, params in others:
        admitted, got[name], cached = generate(
            b, WorkerRequest(f"b-{name}", PROMPT, params, pull=HINT)
        )
        assert admitted.pulled is not None and admitted.pulled.outcome == "missing", name
        assert admitted.pulled.tokens == 0 and cached == 0, name
    want = {}
    for name, params in others:  # worker-0 computes them itself: the same tokens
        _, want[name], cached = generate(a, WorkerRequest(f"a-{name}", PROMPT, params))
        assert cached == 0 and got[name] == want[name], name  # x's blocks served none of them
    admitted, got, cached = generate(b, WorkerRequest("b-x", PROMPT, X, pull=HINT))
    assert admitted.pulled.outcome == "ok" and admitted.pulled.tokens == 80
    assert cached == 80 and got == want_x
    assert ray.get(b.kv_blocks_in_use.remote()) == 0

    # a new worker warms up from the fleet: adapter x's prefix, under adapter x only
    added = cluster.add_worker()
    c = cluster.workers[added]
    deadline = time.monotonic() + 60
    while not ray.get(c.pull_stats.remote())["warm_started"]:
        assert time.monotonic() < deadline, "no warm start"
        time.sleep(0.2)
    # the hottest prefix of the fleet: adapter x's (3 uses; every other context's has 2)
    assert ray.get(c.pull_stats.remote())["warmed_blocks"] == 5
    for name, params in others:
        _, got, cached = generate(c, WorkerRequest(f"c-{name}", PROMPT, params))
        assert cached == 0 and got == want[name], name
    _, got, cached = generate(c, WorkerRequest("c-x", PROMPT, X))
    assert cached == 80 and got == want_x
