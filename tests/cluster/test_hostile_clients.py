"""Hostile clients against the package's real cluster (local Ray, redis-server, tiny model):
JSON nested past every bound inside string fields, over HTTP (raw ``http.client``) and gRPC
(``grpcio``). Each is a 4xx naming the field, nothing is left running or held, and the
cluster serves on."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest

from benchmarks.chaos import wait_idle
from cluster.client import KVClusterClient, build_request
from cluster.launcher import Cluster
from protos.kvcluster.v1 import kvcluster_pb2 as pb

pytestmark = [pytest.mark.ray, pytest.mark.redis]

DEEP_OBJECT = '{"a":' * 5000 + "1" + "}" * 5000  # JSON text 5000 levels deep
DEEP_LIST = "[" * 20000 + "]" * 20000
ASK = [{"role": "user", "content": "hi"}]


def post(cluster: Cluster, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    u = urlsplit(cluster.http_endpoints[0])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_json_nested_inside_string_fields_is_a_400_naming_the_field(cluster: Cluster) -> None:
    m = cluster.model_id
    chat = {"model": m, "messages": ASK, "max_tokens": 2}
    schema_text = {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_OBJECT}}
    cases = [
        ("/v1/chat/completions", {**chat, "guided_json": DEEP_OBJECT}, "guided_json"),
        ("/v1/chat/completions", {**chat, "guided_json": DEEP_LIST}, "guided_json"),
        (
            "/v1/chat/completions",
            {**chat, "structured_outputs": {"json": DEEP_OBJECT}},
            "structured_outputs.json",
        ),
        (
            "/v1/chat/completions",
            {**chat, "response_format": schema_text},
            "response_format.json_schema.schema",
        ),
        (
            "/v1/completions",
            {"model": m, "prompt": "x", "max_tokens": 2, "guided_json": DEEP_OBJECT},
            "guided_json",
        ),
    ]
    failures = []
    for path, body, field in cases:
        status, answer = post(cluster, path, body)
        err = answer.get("error", {})
        if (status, err.get("param")) != (400, field) or "nests over" not in err["message"]:
            failures.append((field, status, err))
    assert not failures, failures
    # a past call's arguments nested too deep to walk are rendered as the text they came as;
    # 40,000 characters of them count against the prompt's cap before anything is rendered
    for arguments, want in (("[" * 40 + "]" * 40, 200), (DEEP_LIST, 400)):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        history = [{"role": "assistant", "content": None, "tool_calls": [call]}, *ASK]
        status, answer = post(cluster, "/v1/chat/completions", {**chat, "messages": history})
        assert status == want, answer
    assert answer["error"]["param"] == "messages", answer
    assert "characters of content and tools" in answer["error"]["message"]
    status, answer = post(cluster, "/tokenize", {"model": m, "messages": history})  # vLLM's
    assert (status, answer["error"]["param"]) == (400, "messages"), answer
    assert wait_idle(cluster)


def test_grpc_json_text_fields_are_bounded(cluster: Cluster) -> None:
    schema = build_request("hi", max_tokens=2)
    schema.params.structured.json_schema = DEEP_OBJECT
    tools = pb.GenerateRequest(
        messages=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content="hi")], tools=DEEP_LIST
        ),
        params=pb.SamplingParams(max_tokens=2),
    )
    calls = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="assistant", tool_calls=DEEP_LIST)]),
        params=pb.SamplingParams(max_tokens=2),
    )
    cases = [
        (schema, "params.structured.json_schema"),
        (tools, "messages.tools"),
        (calls, "messages[0].tool_calls"),
    ]
    with KVClusterClient(cluster.endpoints[0]) as client:
        for req, field in cases:
            with pytest.raises(grpc.RpcError) as err:
                client.stub.GenerateUnary(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert f"invalid {field}=" in err.value.details() and "nests over" in (
                err.value.details()
            )
        assert client.unary("still here", max_tokens=2).usage.completion_tokens == 2
    assert wait_idle(cluster)
