"""The kvcluster.v1 gRPC API on a real cluster: local Ray, real redis-server, real gRPC."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.client import build_request
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from worker.engine import Engine, SamplingParams
from worker.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.redis]

SHARED = (
    "You are a careful assistant that answers questions about distributed systems, "
    "paged attention, prefix caching, routing and Ray actors in great detail. "
) * 2


def blocks_in_use(cluster) -> dict[str, int]:  # noqa: ANN001
    return {
        name: ray.get(h.kv_blocks_in_use.remote(), timeout=30)
        for name, h in cluster.workers.items()
    }


def wait_for(predicate, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_stream_matches_offline_engine_token_for_token(cluster, client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    out = client.generate(prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = Engine.from_model_dir(
        cluster.model_dir, cluster.cfg.workers.engine, model_id=cluster.model_id
    )
    [ref] = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    assert out.token_ids[0] == ref.completions[0].token_ids
    assert out.text == ref.completions[0].text
    assert out.finish_reasons[0] == "length"
    assert out.completion_tokens == 24
    assert out.prompt_tokens == len(Tokenizer.from_dir(cluster.model_dir).encode(prompt))
    assert out.worker_id in cluster.workers
    assert out.num_messages > 1  # streamed, not one blob


def test_shared_prefix_lands_on_the_worker_that_holds_it(cluster, client) -> None:
    first = client.generate(SHARED + "First question?", max_tokens=2, temperature=0.0)
    time.sleep(0.5)  # the worker's KV events reach the index
    later = [
        client.generate(SHARED + f"Question {i}?", max_tokens=2, temperature=0.0) for i in range(3)
    ]
    assert {o.worker_id for o in later} == {first.worker_id}
    for o in later:
        assert o.cached_tokens >= 64, o  # at least the shared full blocks came from cache
        assert o.cached_tokens < o.prompt_tokens
    status = client.status()
    assert status.decisions.get("prefix_affinity/prefix", 0) >= 3
    # every worker sent its own keys back and they equal the router's (one hash function)
    stats = [ray.get(r.stats.remote(), timeout=30) for r in cluster.routers.values()]
    assert sum(s["parity_checks"] for s in stats) >= 4
    assert sum(s["parity_mismatches"] for s in stats) == 0


def test_unary_equals_stream(client) -> None:
    kwargs = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    streamed = client.generate("Unary and streaming agree.", **kwargs)
    result = client.unary("Unary and streaming agree.", **kwargs)
    assert [c.token_ids for c in result.completions] == [streamed.token_ids[0]]
    assert result.completions[0].text == streamed.text
    assert result.completions[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert result.usage.completion_tokens == 8
    assert result.worker_id


def test_parallel_samples_stream_by_index(client) -> None:
    out = client.generate(
        "Sample me three ways", max_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True
    )
    assert sorted(out.token_ids) == [0, 1, 2]
    assert all(len(t) == 6 for t in out.token_ids.values())
    again = client.generate(
        "Sample me three ways", max_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True
    )
    assert again.token_ids == out.token_ids  # same seed, same output


def test_token_id_prompt_and_tokenize(cluster, client) -> None:
    ids = client.tokenize("hello paged world")
    assert ids == Tokenizer.from_dir(cluster.model_dir).encode("hello paged world")
    a = client.generate(ids, max_tokens=5, temperature=0.0, ignore_eos=True)
    b = client.generate("hello paged world", max_tokens=5, temperature=0.0, ignore_eos=True)
    assert a.token_ids == b.token_ids


def test_cluster_status_lists_live_workers_with_epochs(cluster, client) -> None:
    st = client.status()
    assert st.policy == "prefix_affinity" and st.index_available
    assert st.model_id == cluster.model_id
    assert sorted(w.worker_id for w in st.workers) == sorted(cluster.workers)
    assert all(w.alive and w.epoch > 0 and w.total_blocks == 128 for w in st.workers)
    assert all(w.model_load_s > 0 for w in st.workers)  # as each measured its start
    # every router of the cluster, as the launcher told each (one router here)
    assert [(r.grpc_address, r.http_url) for r in st.routers] == list(
        zip(cluster.endpoints, cluster.http_endpoints, strict=True)
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 100}, "n"),
    ],
)
def test_invalid_argument_names_field(client, kwargs, field) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.generate("bad request", **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


def test_prompt_over_max_model_len_is_invalid_argument(client) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.generate([5] * 600, max_tokens=4)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len=512" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:  # the prompt fits; with max_tokens it does not
        client.generate([5] * 500, max_tokens=13)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens=13: must be at most 12: max_model_len=512 minus the prompt's 500" in (
        info.value.details()
    )


def test_client_cancel_frees_every_block(cluster, client) -> None:
    stream = client.stream(
        build_request(
            "Cancel me after two messages. " * 4, max_tokens=400, temperature=0.0, ignore_eos=True
        ),
        timeout=60,
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.cancel()
    assert wait_for(lambda: sum(blocks_in_use(cluster).values()) == 0), blocks_in_use(cluster)


def test_deadline_is_honoured_and_frees_blocks(cluster, client) -> None:
    with pytest.raises(grpc.RpcError) as info:
        client.generate(
            "Too slow for this deadline. " * 4,
            max_tokens=400,
            temperature=0.0,
            ignore_eos=True,
            timeout=0.5,
        )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: sum(blocks_in_use(cluster).values()) == 0), blocks_in_use(cluster)


def test_health_and_reflection(cluster) -> None:
    with grpc.insecure_channel(cluster.endpoints[0]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvcluster.v1.KVCluster"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        [reply] = list(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {"kvcluster.v1.KVCluster", "grpc.health.v1.Health"} <= names


def test_actors_are_named_in_the_cluster_namespace(cluster) -> None:
    named = {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == cluster.namespace
    }
    assert named == {"worker-0", "worker-1", "router-0"}


def test_cli_generate_and_status(cluster) -> None:
    import subprocess
    import sys

    target = cluster.endpoints[0]
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "generate",
            "--target",
            target,
            "--max-tokens",
            "4",
            "Hello from the CLI",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gen.returncode == 0, gen.stderr
    assert "[worker worker-" in gen.stdout and "4 generated" in gen.stdout
    st = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "status", "--target", target],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert st.returncode == 0, st.stderr
    assert "worker-0" in st.stdout and "worker-1" in st.stdout and "quota evict" in st.stdout
    assert "pinned" in st.stdout and "evicted" in st.stdout


def test_bench_load_generator_reports_and_routes(cluster, tmp_path, monkeypatch) -> None:
    import io
    import json

    from benchmarks.loadgen import run_bench

    buf = io.StringIO()
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    figures = run_bench(
        cluster.endpoints[0],
        num_requests=12,
        concurrency=4,
        num_groups=2,
        prefix_words=60,
        max_tokens=4,
        out=buf,
    )
    assert figures["ok"] == 12
    assert figures["prefix_hit_rate"] > 0.3  # two shared system prompts, 12 requests
    last = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert last["bench"]["ok"] == 12
    assert (tmp_path / "cluster_bench.png").exists()


def test_metrics_reach_rays_prometheus_export(cluster, client) -> None:
    """Worker and router metrics (ray.util.metrics) are scraped from the node's Prometheus
    endpoint, tagged by worker / policy and reason (Ray flushes them every few seconds)."""
    client.generate("Count me in the metrics.", max_tokens=3, temperature=0.0)
    port = ray.nodes()[0]["MetricsExportPort"]
    want = {
        "ray_kvc_ttft_seconds_count",
        "ray_kvc_inter_token_seconds_count",
        "ray_kvc_kv_usage",
        "ray_kvc_prefix_hit_rate",
        "ray_kvc_waiting",
        "ray_kvc_tenant_quota_evictions",
        "ray_kvc_routed_requests_total",
    }
    seen: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not want <= set(seen):
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for line in body.decode().splitlines():
            if line.startswith("ray_kvc_"):
                seen[line.split("{")[0]] = line
        time.sleep(1)
    assert want <= set(seen), sorted(want - set(seen))
    assert 'worker="worker-' in seen["ray_kvc_ttft_seconds_count"]
    assert 'policy="prefix_affinity"' in seen["ray_kvc_routed_requests_total"]
