"""The OpenAI-compatible HTTP API against one real cluster (local Ray, redis-server, tiny
model with a ChatML template): the official ``openai`` client, real ``curl``, raw bad bodies.

The cluster has bearer-token auth and small queues (1 worker: 2 running + 2 waiting), so
every error status can be reached for real.
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import io
import json
import os
import shutil
import subprocess
import time
from typing import Any
from urllib.parse import urlsplit

import grpc
import openai
import pytest
import ray

from benchmarks.chaos_probes import on_workers, wait_idle
from benchmarks.loadgen import run_bench
from cluster.client import KVClusterClient, build_request
from cluster.launcher import Cluster
from tests.cluster.conftest import ENGINE, cluster_config
from tests.embedded_ray import shared_ray
from worker.engine.commands import Metrics
from worker.model.default_model import resolve_default_model
from worker.model.tokenizer import Tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.redis]

TOKEN = "tok-alice-0123456789"
BOB = "tok-bob-9876543210"
MAX_BODY = 64 << 10
SYSTEM = ("You are a careful assistant of the kvcluster test suite. " * 8).strip()


@pytest.fixture(scope="module")
def http_cluster() -> Cluster:
    cfg = cluster_config(
        f"http-{os.getpid()}",
        workers={"num_workers": 1, "engine": {**ENGINE, "max_num_seqs": 2, "max_waiting": 2}},
        router={"auth_tokens": {"alice": TOKEN, "bob": BOB}, "max_message_bytes": MAX_BODY},
    )
    shared_ray()  # every cluster of the session on one Ray
    with Cluster(cfg) as c:
        yield c


@pytest.fixture(scope="module")
def base_url(http_cluster: Cluster) -> str:
    return http_cluster.http_endpoints[0]


@pytest.fixture(scope="module")
def model(http_cluster: Cluster) -> str:
    return http_cluster.model_id


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


def raw(
    base_url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    u = urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        hdrs = {
            "Authorization": f"Bearer {TOKEN}",
            "Content-Type": "application/json",
            **(headers or {}),
        }
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def generated_tokens(cluster: Cluster) -> int:
    return sum(
        on_workers(cluster, lambda w: w.engine_loop.call(Metrics()).generation_tokens).values()
    )


def idle_and_unheld(cluster: Cluster) -> bool:
    """No request runs or waits and ClusterStatus shows every KV block free or cached."""
    if not wait_idle(cluster):
        return False
    with KVClusterClient(cluster.endpoints[0], token=TOKEN) as c:
        st = c.status()
    return all(
        w.running == 0 and w.waiting == 0 and w.free_blocks == w.total_blocks for w in st.workers
    )


# -- the official client ----------------------------------------------------------------------


def test_models_and_health(base_url: str, model: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [model]
    status, _, body = raw(base_url, "GET", "/health", headers={"Authorization": ""})
    assert status == 200 and json.loads(body)["live_workers"] == 1


def test_completions_stream_and_not(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(
        model=model, prompt="The cache holds", max_tokens=8, temperature=0
    )
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 0
    parts = list(
        client.completions.create(
            model=model,
            prompt="The cache holds",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert text == whole.choices[0].text
    assert parts[-1].usage.completion_tokens == 8
    # a batch of prompts (text and token ids), n samples each: index = prompt * n + sample
    batch = client.completions.create(
        model=model, prompt=[[1, 2, 3], [4, 5, 6, 7]], max_tokens=3, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == 3 + 4


def test_chat_stream_and_not(client: openai.OpenAI, model: str) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.with_raw_response.create(
        model=model, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    assert whole.headers["x-kvcluster-worker"] == "worker-0"
    res = whole.parse()
    assert res.object == "chat.completion" and res.choices[0].message.role == "assistant"
    assert len(res.choices[0].logprobs.content) == 6
    assert len(res.choices[0].logprobs.content[0].top_logprobs) == 2
    chunks = list(
        client.chat.completions.create(
            model=model, messages=msgs, max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == res.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_cached_tokens_on_repeated_system_prompt(client: openai.OpenAI, model: str) -> None:
    def ask(question: str) -> Any:
        return client.chat.completions.create(
            model=model,
            max_completion_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        )

    first = ask("What is a block?")
    second = ask("What is a page?")
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        > first.usage.prompt_tokens_details.cached_tokens
    )


def test_tenants_and_cache_salt_share_no_kv(
    base_url: str, client: openai.OpenAI, model: str
) -> None:
    """The bearer token's tenant and vLLM's cache_salt scope the prefix cache over HTTP as
    over gRPC: the same prompt hits for its own tenant and salt only."""
    bob = openai.OpenAI(base_url=base_url + "/v1", api_key=BOB, max_retries=0, timeout=60)
    prompt = "Tenant isolation: " + "blocks are keyed by tenant salt " * 6

    def cached(c: openai.OpenAI, **extra: object) -> int:
        r = c.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    cached(client)
    assert cached(client) >= 16  # alice again: her prefix is cached
    assert cached(bob) == 0  # bob, same text: nothing of alice's
    assert cached(client, cache_salt="other") == 0  # alice under another salt


def test_typed_errors(client: openai.OpenAI, base_url: str, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", temperature=-1)
    assert "temperature" in str(bad.value) and "-1" in str(bad.value)
    assert bad.value.body["param"] == "temperature"
    wrong = openai.OpenAI(base_url=base_url + "/v1", api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=model, prompt="x", max_tokens=1)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    assert "gpt-9" in str(missing.value)


def test_full_queues_are_rate_limited(
    client: openai.OpenAI, http_cluster: Cluster, model: str
) -> None:
    def send(i: int) -> str:
        try:
            client.completions.create(
                model=model,
                prompt=f"Burst {i}",
                max_tokens=120,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return "ok"
        except openai.RateLimitError as exc:
            # refused by a worker's full queue, or before it was read once all were full
            assert exc.code == "queues_full" and "full" in str(exc), exc
            assert exc.response.headers["retry-after"] == "1"  # the openai client waits it
            return "429"

    with cf.ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(send, range(12)))
    assert outcomes.count("429") >= 4 and outcomes.count("ok") >= 2, outcomes
    assert idle_and_unheld(http_cluster)


def test_full_queues_refuse_before_reading_the_body(
    http_cluster: Cluster, base_url: str, model: str
) -> None:
    """Once every worker's queue was full, a request is refused before it is parsed (a body
    that is not even JSON gets the 429) until a slot frees; gRPC's the same, with a pushback."""
    long = json.dumps({"model": model, "prompt": "Fill", "max_tokens": 300, "ignore_eos": True})
    unparsed: list[dict[str, Any]] = []
    pushback: list[tuple[str, str]] = []
    with (
        cf.ThreadPoolExecutor(8) as pool,
        KVClusterClient(http_cluster.endpoints[0], token=TOKEN) as grpc_client,
    ):
        burst = [
            pool.submit(raw, base_url, "POST", "/v1/completions", long.encode()) for _ in range(8)
        ]
        while not all(f.done() for f in burst) and not (unparsed and pushback):
            got, headers, answer = raw(base_url, "POST", "/v1/completions", b"{not json")
            if got != 429:
                continue
            unparsed.append({**json.loads(answer)["error"], "retry": headers["retry-after"]})
            # gRPC only while the refusal window is open: a call sent before it would queue
            # behind the burst and return only once a slot freed (the window then shut)
            if not pushback:
                try:
                    grpc_client.unary("Fill", max_tokens=2)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    pushback += exc.trailing_metadata()
        statuses = sorted(f.result()[0] for f in burst)
    assert 429 in statuses and statuses.count(200) >= 2, statuses
    assert unparsed, "no request was refused before it was read"
    assert (unparsed[0]["code"], unparsed[0]["retry"]) == ("queues_full", "1")
    assert "before it was read" in unparsed[0]["message"]
    assert ("grpc-retry-pushback-ms", "1000") in pushback
    got, _, _ = raw(base_url, "POST", "/v1/completions", b"{not json")
    assert got == 400  # the slots freed: parsed again
    assert idle_and_unheld(http_cluster)


# -- curl, parity, disconnects --------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl binary")
def test_curl_streams_sse(base_url: str, model: str) -> None:
    body = json.dumps(
        {
            "model": model,
            "prompt": "Hello",
            "max_tokens": 5,
            "stream": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
    )
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            "-i",
            base_url + "/v1/completions",
            "-H",
            f"Authorization: Bearer {TOKEN}",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    head, _, stream = out.partition("\n\n")  # text mode: \r\n read as \n
    assert "text/event-stream" in head and "x-kvcluster-worker: worker-0" in head
    events = [e for e in stream.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = [c for c in chunks if c["choices"]]
    # one event per token while the client keeps up, several per event when it lags
    assert 1 <= len(text) <= 5
    assert text[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_same_greedy_tokens_over_grpc_and_http(
    http_cluster: Cluster, client: openai.OpenAI, model: str
) -> None:
    tok = Tokenizer.from_dir(http_cluster.model_path or resolve_default_model("llama"))
    prompt = "Routers place requests where the prefix lives"
    msgs = [{"role": "user", "content": prompt}]
    with KVClusterClient(http_cluster.endpoints[0], token=TOKEN) as g:
        text_ids = g.generate(prompt, max_tokens=12, temperature=0.0).token_ids[0]
        chat_ids = g.generate(msgs, max_tokens=12, temperature=0.0).token_ids[0]
    # logprobs name each generated token: the same ids, not only the same text
    text = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0
    ).choices[0]
    assert text.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in text_ids]
    assert text.text == tok.decode(text_ids)
    ids = client.completions.create(
        model=model, prompt=tok.encode(prompt), max_tokens=12, temperature=0
    ).choices[0]
    assert ids.text == text.text
    chat = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=12, temperature=0, logprobs=True
    ).choices[0]
    assert [c.token for c in chat.logprobs.content] == [
        tok.decode([t], skip_special_tokens=False) for t in chat_ids
    ]


def test_stream_interval_joins_steps_into_fewer_messages_on_both_edges(
    http_cluster: Cluster, client: openai.OpenAI, model: str
) -> None:
    """``router.stream_interval`` 4 (set on the live routers): the first token alone, then
    at least 4 steps' tokens per gRPC message and SSE event, the same greedy tokens."""
    prompt, n = "Streams join steps when asked", 13
    params = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}

    def set_interval(k: int) -> None:
        for h in http_cluster.routers.values():
            ray.get(
                h.__ray_call__.remote(lambda r, k=k: setattr(r.directory, "stream_interval", k))
            )

    def grpc_chunks() -> list[list[int]]:
        with KVClusterClient(http_cluster.endpoints[0], token=TOKEN) as g:
            stream = g.stream(build_request(prompt, **params), timeout=60)
            return [list(m.token_ids) for m in stream if m.token_ids]

    def sse_chunks() -> list[list[str]]:
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            stream=True,
            logprobs=0,
            extra_body={"ignore_eos": True},
            **{k: v for k, v in params.items() if k != "ignore_eos"},
        )
        return [c.choices[0].logprobs.tokens for c in stream if c.choices and c.choices[0].logprobs]

    every_step, every_event = grpc_chunks(), sse_chunks()
    set_interval(4)
    try:
        joined, joined_events = grpc_chunks(), sse_chunks()
    finally:
        set_interval(1)
    for chunks, base in ((joined, every_step), (joined_events, every_event)):
        assert [t for c in chunks for t in c] == [t for c in base for t in c]
        assert len(chunks) <= 1 + -(-(n - 1) // 4) < len(base)
        assert all(len(c) >= 4 for c in chunks[1:-1]), chunks


def test_client_disconnect_aborts_on_the_worker(
    http_cluster: Cluster, base_url: str, model: str
) -> None:
    """A client that leaves mid-stream, or while waiting for a whole answer, stops its
    request on the worker: it frees its blocks without generating its max_tokens."""
    u = urlsplit(base_url)
    max_tokens = 480  # about 10x what the tiny model generates in the time this takes
    for stream in (True, False):
        before = generated_tokens(http_cluster)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        payload = {
            "model": model,
            "prompt": "Go on and on",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps(payload),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        if stream:
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
        else:
            time.sleep(0.3)  # queued or running, no answer yet
        conn.sock.close()
        conn.close()
        assert idle_and_unheld(http_cluster)
        assert generated_tokens(http_cluster) - before < max_tokens


# -- bad inputs -------------------------------------------------------------------------------

M = "MODEL"  # replaced by the served model id
BAD: list[tuple[str, Any, int, str]] = [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"", 400, "not valid JSON"),
    ("/v1/completions", b"\xff\xfe{}", 400, "not valid JSON"),
    ("/v1/completions", b"[" * 100000 + b"]" * 100000, 413, "over the limit"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", b'"prompt"', 400, "JSON object"),
    ("/v1/completions", {"model": M, "prompt": "x" * (MAX_BODY + 1)}, 413, "65536 bytes"),
    ("/v1/completions", {"model": 7, "prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": M}, 400, "prompt"),
    # errors name the field as the OpenAI API spells it, not as gRPC does (text, token_ids)
    ("/v1/completions", {"model": M, "prompt": ""}, 400, "invalid prompt=''"),
    ("/v1/completions", {"model": M, "prompt": [[]]}, 400, "invalid prompt=[]"),
    ("/v1/completions", {"model": M, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": M, "prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"model": M, "prompt": [-5]}, 400, "prompt"),
    ("/v1/completions", {"model": M, "prompt": [10**9]}, 400, "vocab_size"),
    ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"model": M, "prompt": "hi", "max_tokens": 1.5}, 400, "integer"),
    ("/v1/completions", {"model": M, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": M, "prompt": "hi", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"model": M, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": M, "prompt": "hi", "n": 1000}, 400, "max_n"),
    # prompts x n choices are bounded as one request's n is (one answer holds them all)
    ("/v1/completions", {"model": M, "prompt": ["a"] * 4, "n": 5}, 400, "times 4 prompts"),
    ("/v1/completions", {"model": M, "prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ("/v1/completions", {"model": M, "prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"model": M, "prompt": "hi", "stop": ["a"] * 40}, 400, "stop"),
    ("/v1/completions", {"model": M, "prompt": "hi", "seed": 2**64}, 400, "seed"),
    (
        "/v1/completions",
        {"model": M, "prompt": "hi", "presence_penalty": 9},
        400,
        "presence_penalty",
    ),
    ("/v1/completions", {"model": M, "prompt": "hi", "prompt_logprobs": 99}, 400, "max_logprobs"),
    # raw surrogate bytes (not UTF-8), in a value or a key: a 400, not a 500
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', 400, "not UTF-8"),
    ("/v1/completions", b'{"prompt": "x", "\xed\xa0\x80": 1}', 400, "not UTF-8"),
    # a client's request id is bounded as over gRPC
    ("/v1/completions", {"model": M, "prompt": "hi", "request_id": "r" * 20000}, 400, "128"),
    (
        "/v1/completions",
        {"model": M, "prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream=true",
    ),
    ("/v1/completions", {"model": M, "prompt": "hi", "cache_salt": "s" * 300}, 400, "cache_salt"),
    ("/v1/completions", {"model": M, "prompt": "hi " * 3000}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "nope"),
    ("/v1/chat/completions", {"model": M}, 400, "messages"),
    ("/v1/chat/completions", {"model": M, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": M, "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": M, "messages": ["hello"]}, 400, "messages[0]"),
    (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": 3}]},
        400,
        "messages[0].content",
    ),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user"}]}, 400, "content"),
    (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 2,
            "max_tokens": "x",
        },
        400,
        "max_tokens='str'",
    ),
    (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 2,
            "max_tokens": -5,
        },
        400,
        "max_tokens=-5",
    ),
    (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "x", "name": {"a": 1}}]},
        400,
        "messages[0].name",
    ),
    (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "x", "mood": "sad"}]},
        400,
        "mood",
    ),
    (
        "/v1/chat/completions",
        {
            "model": M,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        400,
        "content[0]",
    ),
    (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "logprobs=true",
    ),
    (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "x"}], "tools": []},
        400,
        "tools",
    ),
    # long values are quoted by their length, not echoed
    ("/v1/completions", {"model": "m" * 5000, "prompt": "hi"}, 404, "<5000 chars>"),
    (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "r" * 5000, "content": "x"}]},
        400,
        "<5000 chars>",
    ),
    # text with no UTF-8 form (a lone surrogate escape) is a 400 naming where, not a 500
    ("/v1/completions", {"model": M, "prompt": "\ud800"}, 400, "prompt"),
    ("/v1/completions", {"model": M, "prompt": "hi", "stop": ["a", "\udfff"]}, 400, "stop[1]"),
    ("/v1/completions", {"model": M, "prompt": "hi", "cache_salt": "\ud800"}, 400, "surrogate"),
    (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "\ud83d"}]},
        400,
        "messages[0].content",
    ),
    # request_id is echoed in the x-request-id header: a 400, not a 500 or a dropped connection
    ("/v1/completions", {"model": M, "prompt": "hi", "request_id": "\u20acuro"}, 400, "ASCII"),
    ("/v1/completions", {"model": M, "prompt": "hi", "request_id": "a\r\nX: y"}, 400, "ASCII"),
    # a conversation over the prompt character cap is refused before it is rendered
    (
        "/v1/chat/completions",
        {"model": M, "messages": [{"role": "user", "content": "word " * 2000}]},
        400,
        "<10000 chars>",
    ),
    ("/v1/models", None, 405, "not allowed"),
    ("/v1/nothing", {}, 404, "no route"),
]


def test_table_has_at_least_25_cases() -> None:
    assert len(BAD) >= 25


def test_bad_inputs_get_4xx_naming_the_problem(
    http_cluster: Cluster, base_url: str, model: str
) -> None:
    failures = []
    for path, body, status, needle in BAD:
        if isinstance(body, dict):
            body = json.dumps(body).replace('"MODEL"', json.dumps(model)).encode()
        got, _, answer = raw(base_url, "POST", path, body)
        err = json.loads(answer).get("error", {})
        if got != status or needle not in err.get("message", ""):
            failures.append((path, (body or b"")[:80], got, err))
    assert not failures, failures
    unauth, _, answer = raw(
        base_url, "POST", "/v1/completions", b"{", headers={"Authorization": "Bearer wrong"}
    )
    assert unauth == 401 and "bearer token" in json.loads(answer)["error"]["message"]
    assert idle_and_unheld(http_cluster)
    # and the API still serves
    ok, _, answer = raw(
        base_url,
        "POST",
        "/v1/completions",
        # (ignore_eos: a sampled EOS would end it after one token)
        json.dumps(
            {"model": model, "prompt": "still", "max_tokens": 2, "ignore_eos": True}
        ).encode(),
    )
    assert ok == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2
    # an escaped surrogate pair is one valid character; a printable request_id is echoed
    body = {"model": model, "prompt": "smile \U0001f600", "max_tokens": 2, "request_id": "r-1"}
    ok, headers, answer = raw(base_url, "POST", "/v1/completions", json.dumps(body).encode())
    assert ok == 200 and headers["x-request-id"] == "cmpl-r-1", answer


def test_kvcluster_bench_drives_the_http_api(
    base_url: str, http_cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
    out = io.StringIO()
    figures = run_bench(
        base_url,
        api="http",
        num_requests=6,
        concurrency=2,
        num_groups=1,
        prefix_words=60,
        max_tokens=4,
        plot=False,
        out=out,
    )
    assert figures["ok"] == 6 and figures["ttft_p50_s"] > 0
    assert figures["prefix_hit_rate"] > 0  # one shared system prompt: later requests hit
    assert json.loads(out.getvalue().splitlines()[-1])["api"] == "http"
    assert idle_and_unheld(http_cluster)


def test_no_live_worker_is_503_zz_last(http_cluster: Cluster, base_url: str, model: str) -> None:
    """Runs last in this module: it kills the cluster's only worker."""
    ray.kill(http_cluster.workers["worker-0"], no_restart=True)
    body = json.dumps({"model": model, "prompt": "anyone there?", "max_tokens": 2}).encode()
    deadline = time.monotonic() + 30
    while True:  # until the router sees the heartbeat lapse
        status, headers, answer = raw(base_url, "POST", "/v1/completions", body)
        if status == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status == 503 and "no live worker" in json.loads(answer)["error"]["message"]
    assert headers["retry-after"] == "1"
    health, _, _ = raw(base_url, "GET", "/health")
    assert health == 503
