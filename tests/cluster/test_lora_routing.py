"""LoRA adapters on a real cluster: run-time registration, routing by adapter and prefix,
no cross-adapter KV, unknown adapter -> INVALID_ARGUMENT, adapters in ClusterStatus."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
import ray

from worker.model.build_tiny_lora import build_tiny_lora

pytestmark = [pytest.mark.ray, pytest.mark.redis]

PROMPT = (
    "A long shared instruction about paged attention and prefix caching, repeated so "
    "it spans several KV blocks of sixteen tokens each. "
) * 3


def _status_adapters(client) -> dict[str, dict[str, bool]]:  # noqa: ANN001
    return {w.worker_id: {a.name: a.loaded for a in w.adapters} for w in client.status().workers}


def test_adapter_requests_land_where_the_adapter_and_prefix_are(cluster, client, tmp_path):
    w0, w1 = sorted(cluster.workers)
    only0 = build_tiny_lora(tmp_path / "only0", cluster.model_dir, rank=4, seed=11)
    both = build_tiny_lora(tmp_path / "both", cluster.model_dir, rank=4, seed=12)
    ids = {
        w0: ray.get(
            [
                cluster.workers[w0].add_lora.remote(n, str(p))
                for n, p in (("only0", only0), ("both", both))
            ],
            timeout=60,
        ),
        w1: ray.get(cluster.workers[w1].add_lora.remote("both", str(both)), timeout=60),
    }
    assert ids[w0][1] == ids[w1]  # one adapter, one id, whatever the worker
    assert set(_status_adapters(client)[w0]) == {"only0", "both"}
    deadline = time.monotonic() + 15  # the next heartbeats bring the adapters to the router
    while True:
        try:
            for name in ("only0", "both"):
                client.generate("warm", max_tokens=1, lora=name)
            break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or time.monotonic() > deadline:
                raise
            time.sleep(0.2)

    # only one worker serves "only0": every request goes there, whatever its prompt
    outs = [
        client.generate(f"{i} " + PROMPT, max_tokens=2, temperature=0.0, lora="only0")
        for i in range(3)
    ]
    assert {o.worker_id for o in outs} == {w0}
    # "both" runs anywhere; repeats of one prompt follow its cached prefix
    first = client.generate(PROMPT + "first", max_tokens=2, temperature=0.0, lora="both")
    time.sleep(0.5)  # KV events reach the index
    again = [
        client.generate(PROMPT + f"again {i}", max_tokens=2, temperature=0.0, lora="both")
        for i in range(3)
    ]
    assert {o.worker_id for o in again} == {first.worker_id}
    assert all(o.cached_tokens >= 64 for o in again), [o.cached_tokens for o in again]
    # the same prompt with another adapter (or none) shares no KV with it
    other = client.generate(PROMPT + "first", max_tokens=2, temperature=0.0, lora="only0")
    base = client.generate(PROMPT + "first", max_tokens=2, temperature=0.0)
    assert other.cached_tokens == 0 and base.cached_tokens == 0
    status = _status_adapters(client)
    assert status[w0]["only0"] is True  # in a slot after serving

    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPT, max_tokens=2, lora="nope")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nope" in err.value.details() and "unknown adapter" in err.value.details()

    # the OpenAI HTTP door: adapters are models; `model` picks one
    base_url = cluster.http_endpoints[0]
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as resp:
        models = {m["id"]: m for m in json.load(resp)["data"]}
    assert {"only0", "both"} <= set(models) and models["both"]["parent"] == cluster.model_id
    grpc_out = client.generate(PROMPT + "http", max_tokens=4, temperature=0.0, lora="only0")
    body = {"model": "only0", "prompt": PROMPT + "http", "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.load(resp)
    assert out["choices"][0]["text"] == grpc_out.text
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64  # its KV, on w0
