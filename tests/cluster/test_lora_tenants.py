"""Adapters owned by tenants, on a real cluster with two bearer tokens: a tenant sees
(``/v1/models``, ClusterStatus) and runs only its own adapters and the shared ones; another
tenant's adapter is as unknown to it as a name nobody serves. Registered in the config and at
run time, and loaded through vLLM's /v1/load_lora_adapter by a tenant, for it alone, outliving
the worker that loaded it. And an adapter whose logits turn NaN fails its request with a clear
error: no plain 500, no NaN in any JSON body or SSE event."""

from __future__ import annotations

import http.client
import json
import math
import os
import time
from urllib.parse import urlsplit

import grpc
import pytest
import ray

from benchmarks.chaos_probes import on_workers
from cluster.client import KVClusterClient
from cluster.launcher import Cluster
from tests.cluster.conftest import ENGINE, cluster_config
from tests.embedded_ray import shared_ray
from worker.model.build_tiny_lora import build_tiny_lora
from worker.model.default_model import resolve_default_model

pytestmark = [pytest.mark.ray, pytest.mark.redis]

ALICE, BOB = "tok-alice-0123456789", "tok-bob-9876543210"


@pytest.fixture(scope="module")
def owned(tmp_path_factory) -> Cluster:
    root = tmp_path_factory.mktemp("tenant-loras")
    model_dir = resolve_default_model("llama")
    paths = {
        n: str(build_tiny_lora(root / n, model_dir, rank=4, seed=s))
        for s, n in enumerate(("alices", "shared", "bobs", "poison"))
    }
    engine = {
        **ENGINE,
        "lora_adapters": {n: paths[n] for n in ("alices", "shared", "poison")},
        "lora_tenants": {"alices": ["alice"]},
    }
    cfg = cluster_config(
        f"tenants-{os.getpid()}",
        workers={"num_workers": 1, "engine": engine},
        router={"auth_tokens": {"alice": ALICE, "bob": BOB}, "runtime_lora": True},
    )
    shared_ray()  # every cluster of the session on one Ray
    with Cluster(cfg) as c:
        (worker,) = c.workers.values()
        ray.get(worker.add_lora.remote("bobs", paths["bobs"], ["bob"]), timeout=60)
        yield c


def call(cluster: Cluster, token: str, method: str, path: str, body: dict | None = None):
    u = urlsplit(cluster.http_endpoints[0])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        conn.request(method, path, json.dumps(body) if body else None, headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def strict_json(data: bytes | str):
    """JSON with no NaN or Infinity in it (Python's json would read them)."""

    def refuse(name: str):
        raise AssertionError(f"{name} in {data!r}")

    return json.loads(data, parse_constant=refuse)


def models(cluster: Cluster, token: str) -> set[str]:
    status, body = call(cluster, token, "GET", "/v1/models")
    assert status == 200, body
    return {m["id"] for m in strict_json(body)["data"]} - {cluster.model_id}


def test_each_tenant_sees_and_runs_its_own_adapters_only(owned: Cluster) -> None:
    deadline = time.monotonic() + 15  # the run-time registration reaches the router
    while models(owned, BOB) != {"bobs", "shared", "poison"}:
        assert time.monotonic() < deadline, models(owned, BOB)
        time.sleep(0.2)
    assert models(owned, ALICE) == {"alices", "shared", "poison"}

    def complete(token: str, model: str):
        body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        status, data = call(owned, token, "POST", "/v1/completions", body)
        return status, strict_json(data)

    assert complete(ALICE, "alices")[0] == 200 and complete(BOB, "bobs")[0] == 200
    assert complete(BOB, "shared")[0] == 200
    # another tenant's adapter: the same 404 as a model nobody serves
    for token, theirs in ((BOB, "alices"), (ALICE, "bobs")):
        status, err = complete(token, theirs)
        status_nope, nope = complete(token, "nope")
        assert status == status_nope == 404
        assert err["error"]["code"] == nope["error"]["code"] == "model_not_found"
        assert err["error"]["message"] == nope["error"]["message"].replace("nope", theirs)

    # gRPC: ClusterStatus lists a tenant's adapters; another's is an unknown adapter
    for token, mine, theirs in ((ALICE, "alices", "bobs"), (BOB, "bobs", "alices")):
        with KVClusterClient(owned.endpoints[0], token=token) as client:
            (w,) = client.status().workers
            assert {a.name for a in w.adapters} == {mine, "shared", "poison"}
            assert client.generate("hi", max_tokens=2, lora=mine).completion_tokens == 2
            with pytest.raises(grpc.RpcError) as info:
                client.generate("hi", max_tokens=2, lora=theirs)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{theirs!r}: unknown adapter" in info.value.details()
            assert theirs not in info.value.details().split("serve:")[1]  # nor listed


def test_nan_logits_fail_the_request_cleanly_over_http(owned: Cluster) -> None:
    def poison(worker) -> None:  # noqa: ANN001 - the worker actor
        def spoil(engine) -> None:  # noqa: ANN001
            # registration refuses NaN weights; here they turn NaN afterwards (as an
            # overflow on some input would make the logits)
            engine.executor.adapter("poison").weights[(1, "down_proj")][1].fill_(math.nan)
            if engine.executor.runner.lora is not None:
                engine.executor.runner.lora.drop("poison")  # reload from the host weights

        with worker.engine_loop.paused() as engine:
            spoil(engine)

    on_workers(owned, poison)
    body = {"model": "poison", "prompt": "Hello", "max_tokens": 3, "logprobs": 2}
    status, data = call(owned, ALICE, "POST", "/v1/completions", body)
    err = strict_json(data)["error"]
    assert status == 500 and err["type"] == "internal_error", data
    assert "non-finite logits" in err["message"] and "'poison'" in err["message"]

    u = urlsplit(owned.http_endpoints[0])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"Authorization": f"Bearer {ALICE}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), headers)
    resp = conn.getresponse()
    events = [e for e in resp.read().decode().split("\n\n") if e.strip()]
    conn.close()
    payloads = [strict_json(e.removeprefix("data: ")) for e in events if e != "data: [DONE]"]
    assert "non-finite logits" in payloads[-1]["error"]["message"], events
    assert not any(c.get("choices") for c in payloads[:-1])  # no token came before it
    # the worker serves on
    ok = {"model": owned.model_id, "prompt": "Hello", "max_tokens": 2, "logprobs": 1}
    assert call(owned, ALICE, "POST", "/v1/completions", ok)[0] == 200


def test_an_adapter_loaded_at_run_time_outlives_its_worker(owned: Cluster, tmp_path) -> None:  # noqa: ANN001
    path = str(build_tiny_lora(tmp_path / "rt", resolve_default_model("llama"), rank=4, seed=9))
    load = {"lora_name": "alices-rt", "lora_path": path}
    status, body = call(owned, ALICE, "POST", "/v1/load_lora_adapter", load)
    assert status == 200 and b"added successfully" in body, body
    assert "alices-rt" in models(owned, ALICE)  # this router routes to it on the answer
    assert "alices-rt" not in models(owned, BOB)

    def complete(token: str) -> tuple[int, dict]:
        body = {"model": "alices-rt", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        status, data = call(owned, token, "POST", "/v1/completions", body)
        return status, strict_json(data)

    status, first = complete(ALICE)
    assert status == 200, first
    assert complete(BOB)[0] == 404
    with KVClusterClient(owned.endpoints[0], token=ALICE) as client:
        (w,) = client.status().workers
        epoch0 = w.epoch
        (worker,) = owned.workers.values()
        ray.kill(worker, no_restart=False)  # Ray restarts it: it loads the registry's adapters

        def back() -> bool:
            (w,) = client.status().workers
            return w.epoch > epoch0 and w.alive and "alices-rt" in {a.name for a in w.adapters}

        deadline = time.monotonic() + 120
        while not back():
            assert time.monotonic() < deadline, "the restarted worker does not serve it"
            time.sleep(0.5)
    deadline = time.monotonic() + 30
    while (again := complete(ALICE))[0] != 200:
        assert time.monotonic() < deadline, again
        time.sleep(0.5)
    assert again[1]["choices"][0]["text"] == first["choices"][0]["text"]  # the same adapter

    unload = {"lora_name": "alices-rt"}
    assert call(owned, BOB, "POST", "/v1/unload_lora_adapter", unload)[0] == 404
    status, body = call(owned, ALICE, "POST", "/v1/unload_lora_adapter", unload)
    assert status == 200 and b"removed successfully" in body, body
    deadline = time.monotonic() + 15
    while "alices-rt" in models(owned, ALICE):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert complete(ALICE)[0] == 404
