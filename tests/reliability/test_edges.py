"""The reliability pieces that need no cluster: the decode guard on a real gRPC server,
tenant salts, the wire-format field finder, the router's max_tokens limit."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import ray
import redis

from cluster import launcher, ray_session
from cluster import state as cluster_state
from cluster.config import redact_url
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from protos.kvcluster.v1 import kvcluster_pb2_grpc as pb_grpc
from router.edge.convert import malformed_reason, spec_from_pb
from router.edge.interceptors import DecodeGuard
from router.serving.core import ModelLimits, check_limits
from router.serving.generate_spec import tenant_salt
from tests.cluster.conftest import cluster_config
from tests.embedded_ray import no_ray
from tests.reliability.helpers import raw_string_field
from worker.engine import InvalidRequest, SamplingParams

LIMITS = ModelLimits(model_id="m", vocab_size=100, max_model_len=64, max_prompt_tokens=63)


class Echo(pb_grpc.KVClusterServicer):
    async def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        yield pb.GenerateResponse(text=request.text or request.WhichOneof("prompt") or "-")

    async def Tokenize(self, request, context):  # noqa: ANN001, ANN201, N802
        return pb.TokenizeResponse(token_ids=[len(request.text)])


async def _calls(payloads: list[tuple[str, bytes]]) -> list[tuple[str, str]]:
    server = grpc.aio.server(interceptors=[DecodeGuard()])
    pb_grpc.add_KVClusterServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            for method, data in payloads:
                try:
                    if method == "Generate":
                        call = ch.unary_stream(f"/kvcluster.v1.KVCluster/{method}")
                        msgs = [
                            pb.GenerateResponse.FromString(m) async for m in call(data, timeout=10)
                        ]
                        out.append(("OK", msgs[0].text))
                    else:
                        reply = await ch.unary_unary(f"/kvcluster.v1.KVCluster/{method}")(
                            data, timeout=10
                        )
                        out.append(("OK", str(pb.TokenizeResponse.FromString(reply).token_ids)))
                except grpc.aio.AioRpcError as exc:
                    out.append((exc.code().name, exc.details()))
    finally:
        await server.stop(0)
    return out


def test_decode_guard_turns_parse_failures_into_invalid_argument() -> None:
    results = asyncio.run(
        _calls(
            [
                ("Generate", pb.GenerateRequest(text="fine").SerializeToString()),
                ("Generate", raw_string_field(2, b"\xff\xfe")),
                ("Generate", b"\x0a\x05ab"),  # request_id claims 5 bytes, 2 follow
                ("Tokenize", raw_string_field(1, b"\xc0\xaf")),
                ("Tokenize", pb.TokenizeRequest(text="four").SerializeToString()),
            ]
        )
    )
    assert results[0] == ("OK", "fine")
    assert results[1][0] == "INVALID_ARGUMENT" and "invalid text: not valid UTF-8" in results[1][1]
    assert results[2][0] == "INVALID_ARGUMENT"
    assert "not a valid kvcluster.v1.GenerateRequest (4 bytes)" in results[2][1]
    assert results[3][0] == "INVALID_ARGUMENT" and "invalid text" in results[3][1]
    assert results[4] == ("OK", "[4]")


def test_malformed_reason_names_nested_string_fields() -> None:
    params = raw_string_field(11, b"ok") + raw_string_field(11, b"\xe2\x82")
    data = pb.GenerateRequest(text="x").SerializeToString() + raw_string_field(4, params)
    assert malformed_reason(pb.GenerateRequest.DESCRIPTOR, data, ValueError("bad")).startswith(
        "invalid params.stop: not valid UTF-8"
    )
    corrupt = malformed_reason(pb.GenerateRequest.DESCRIPTOR, b"\xff", ValueError("corrupt"))
    assert corrupt == "request is not a valid kvcluster.v1.GenerateRequest (1 bytes): corrupt"


def test_tenant_salt_scopes_every_client_salt_to_its_tenant() -> None:
    assert tenant_salt(None, "") is None and tenant_salt("", "s") == tenant_salt(None, "s")
    assert tenant_salt("", "s") != tenant_salt("", "t")
    # without auth a client salt is its own namespace: it cannot name tenant X's KV
    assert tenant_salt(None, "tenant:alice") != tenant_salt("alice", "")
    posed = spec_from_pb(pb.GenerateRequest(text="hi", cache_salt="tenant:alice"))
    real = spec_from_pb(pb.GenerateRequest(text="hi", tenant="alice"), tenant="alice")
    assert posed.params.cache_salt != real.params.cache_salt
    assert tenant_salt("alice", "") == "tenant:alice"
    forged = tenant_salt("bob", tenant_salt("alice", ""))  # bob asks for alice's salt
    assert forged.startswith("tenant:bob#") and forged != tenant_salt("alice", "")
    assert tenant_salt("bob", "x") != tenant_salt("bob", "y")
    assert len(tenant_salt("t" * 64, "s" * 256)) <= 256  # SamplingParams' own limit
    spec = spec_from_pb(pb.GenerateRequest(text="hi", cache_salt="s"), tenant="bob")
    assert spec.params.cache_salt == tenant_salt("bob", "s")


def test_max_tokens_over_what_the_prompt_leaves_is_rejected_before_routing() -> None:
    check_limits([1, 2], SamplingParams(max_tokens=62), LIMITS)  # the context exactly full
    with pytest.raises(
        InvalidRequest,
        match=r"max_tokens=63: must be at most 62: max_model_len=64 minus the prompt's 2 tokens",
    ):
        check_limits([1, 2], SamplingParams(max_tokens=63), LIMITS)


def test_redis_password_is_redacted_and_the_state_file_is_private(tmp_path, monkeypatch) -> None:
    url = "rediss://kv:s3cret@[::1]:6380/0?ssl_ca_certs=/ca.pem"
    assert redact_url(url) == "rediss://kv:***@[::1]:6380/0?ssl_ca_certs=/ca.pem"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    monkeypatch.setattr(cluster_state, "STATE_DIR", tmp_path)
    state = launcher.ClusterState(**{f: None for f in launcher.ClusterState.__dataclass_fields__})
    state.name, state.redis_url = "c", url
    path = state.save()
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.ray
@pytest.mark.redis
def test_a_cluster_that_fails_to_start_leaves_nothing_running(tmp_path) -> None:
    """Workers cannot load a model from an empty folder: up() fails after Redis and Ray
    started, and the context manager stops both."""
    no_ray()  # the cluster starts (and must stop) a Ray of its own
    cluster = launcher.Cluster(cluster_config("rel-broken", model={"path": str(tmp_path)}))
    with pytest.raises(Exception, match="creation task"):
        with cluster:
            pass
    assert not ray.is_initialized()
    assert cluster.redis is not None and not cluster.redis.alive()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(cluster.redis_url, socket_timeout=1).ping()


@pytest.mark.ray
@pytest.mark.redis
def test_workers_that_cannot_be_placed_time_out_naming_them_and_the_setting() -> None:
    """Workers asking for a GPU on this CPU-only Ray stay pending (as on a cloud cluster whose
    GPU nodes have not joined yet): up() gives up after workers.start_timeout_s, names the
    pending workers and the setting, and stops what it started."""
    no_ray()  # the cluster starts (and must stop) a Ray of its own
    cfg = cluster_config("rel-no-gpu", workers={"use_gpu": True, "start_timeout_s": 3})
    cluster = launcher.Cluster(cfg)
    with pytest.raises(TimeoutError) as info:
        with cluster:
            pass
    msg = str(info.value)
    assert "worker-0, worker-1 not ready within 3s" in msg
    assert "workers.start_timeout_s" in msg and "num_gpus=1" in msg
    assert not ray.is_initialized()
    assert cluster.redis is not None and not cluster.redis.alive()


@pytest.mark.ray
@pytest.mark.redis
def test_a_detached_up_that_fails_stops_its_ray_head_and_redis(tmp_path, monkeypatch) -> None:
    """`kvcluster up` (detached) starts its own Ray head and redis-server as separate process
    groups; when workers then fail to start, both are stopped, not left behind."""
    no_ray()  # the cluster starts (and must stop) a Ray of its own
    monkeypatch.setattr(cluster_state, "STATE_DIR", tmp_path / "state")
    model_dir = tmp_path / "empty-model"
    model_dir.mkdir()
    cluster = launcher.Cluster(
        cluster_config("rel-broken-detached", model={"path": str(model_dir)}), detached=True
    )
    started: list[int] = []
    real_head, real_redis = ray_session.start_ray_head, launcher.start_detached

    def head(*args: object, **kwargs: object):  # noqa: ANN202 - records the pid it started
        address, pid, dash = real_head(*args, **kwargs)
        started.append(pid)
        return address, pid, dash

    def detached_redis(*args: object, **kwargs: object):  # noqa: ANN202
        url, pid = real_redis(*args, **kwargs)
        started.append(pid)
        return url, pid

    monkeypatch.setattr(ray_session, "start_ray_head", head)
    monkeypatch.setattr(launcher, "start_detached", detached_redis)
    with pytest.raises(Exception, match="creation task"):
        cluster.up()
    assert len(started) == 2
    assert not any(cluster_state.group_alive(pid) for pid in started)
    assert not ray.is_initialized()
