"""Malformed requests, table-driven: each gets the right gRPC code and a message naming the
field and the limit it broke; the cluster serves normally afterwards.

Requests a protobuf library refuses to build (non-UTF-8 strings, corrupt bytes) are sent as
raw bytes. Limits of this cluster: vocab 512, max_model_len 512, max_num_seqs 2, 256 KiB
messages (see conftest).
"""

from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.client import build_request
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from tests.reliability.guard.conftest import MAX_MESSAGE_BYTES
from tests.reliability.helpers import CALL_TIMEOUT_S, code_of, raw_generate, raw_string_field

INVALID = grpc.StatusCode.INVALID_ARGUMENT
VOCAB = 512  # the tiny model's vocabulary
OK_PROMPT = "A perfectly fine prompt."


def req(prompt: object = OK_PROMPT, **kwargs: object) -> bytes:
    return build_request(prompt, **kwargs).SerializeToString()


def with_params(raw_params: bytes, prompt: str = OK_PROMPT) -> bytes:
    """A request whose SamplingParams (field 4) are the given raw bytes."""
    return pb.GenerateRequest(text=prompt).SerializeToString() + raw_string_field(4, raw_params)


# (case id, request bytes, expected code, substrings the details must contain)
CASES = [
    # the prompt
    ("empty-text", req(""), INVALID, ["text", "non-empty"]),
    (
        "empty-token-ids",
        pb.GenerateRequest(token_ids=pb.TokenIds()).SerializeToString(),
        INVALID,
        ["token_ids", "at least one"],
    ),
    (
        "no-prompt",
        pb.GenerateRequest(request_id="r").SerializeToString(),
        INVALID,
        ["prompt", "exactly one of text, token_ids or messages"],
    ),
    # chat messages (rendered with the tiny model's ChatML template)
    (
        "chat-unknown-role",
        req([{"role": "robot", "content": "hi"}]),
        INVALID,
        ["messages", "messages[0].role='robot'", "system, developer, user, assistant"],
    ),
    (
        "chat-empty-content",
        req([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  "}]),
        INVALID,
        ["messages", "messages[1].content is empty"],
    ),
    (
        "chat-no-messages",
        pb.GenerateRequest(messages=pb.ChatMessages()).SerializeToString(),
        INVALID,
        ["messages", "at least one message"],
    ),
    ("non-utf8-text", raw_string_field(2, b"caf\xe9 au lait \xff"), INVALID, ["text", "UTF-8"]),
    (
        "non-utf8-request-id",
        req() + raw_string_field(1, b"\xc3\x28"),
        INVALID,
        ["request_id", "UTF-8"],
    ),
    (
        "non-utf8-stop",
        with_params(raw_string_field(11, b"\xed\xa0\x80")),
        INVALID,
        ["params.stop", "UTF-8"],
    ),
    (
        "corrupt-wire-format",
        b"\x12\xff\xff\xff\xff\x0f",
        INVALID,
        ["not a valid kvcluster.v1.GenerateRequest"],
    ),
    ("token-id-over-vocab", req([1, VOCAB]), INVALID, ["token_ids", f"vocab_size={VOCAB}"]),
    ("token-id-huge", req([2**32 - 1]), INVALID, ["token_ids", f"vocab_size={VOCAB}"]),
    ("token-prompt-over-max-model-len", req([5] * 600), INVALID, ["prompt", "max_model_len=512"]),
    (
        "text-prompt-over-max-model-len",
        req("word " * 3000),
        INVALID,
        ["prompt", "max_model_len=512"],
    ),
    (
        "message-over-max-message-bytes",
        req("x" * (MAX_MESSAGE_BYTES + 1000)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        [str(MAX_MESSAGE_BYTES)],
    ),
    # sampling parameters
    ("temperature-negative", req(temperature=-1.0), INVALID, ["temperature", ">= 0"]),
    ("temperature-nan", req(temperature=math.nan), INVALID, ["temperature", "finite"]),
    ("temperature-inf", req(temperature=math.inf), INVALID, ["temperature", "finite"]),
    ("top-p-zero", req(top_p=0.0), INVALID, ["top_p", "(0, 1]"]),
    ("top-p-over-one", req(top_p=1.5), INVALID, ["top_p", "(0, 1]"]),
    ("top-p-nan", req(top_p=math.nan), INVALID, ["top_p", "finite"]),
    ("min-p-over-one", req(min_p=2.0), INVALID, ["min_p", "[0, 1]"]),
    ("length-penalty-nan", req(length_penalty=math.nan), INVALID, ["length_penalty", "finite"]),
    # the attack of issue 13: (len + 1) ** 2000 overflowed in the engine and stopped it
    (
        "beam-length-penalty-huge",
        req(beam_width=2, length_penalty=2000.0),
        INVALID,
        ["length_penalty", "[-10, 10]"],
    ),
    ("n-over-hard-limit", req(n=1000), INVALID, ["n", "at most 16", "router.limits.max_n"]),
    ("n-over-max-num-seqs", req(n=3), INVALID, ["n", "max_num_seqs=2"]),
    (
        "beam-width-over-hard-limit",
        req(beam_width=1000),
        INVALID,
        ["beam_width", "at most 16", "router.limits.max_n"],
    ),
    ("beam-width-over-max-num-seqs", req(beam_width=4), INVALID, ["beam_width", "max_num_seqs=2"]),
    ("n-over-beam-width", req(beam_width=2, n=3), INVALID, ["n", "beam_width=2"]),
    ("beam-with-stop-strings", req(beam_width=2, stop=["."]), INVALID, ["stop", "beam search"]),
    ("beam-with-logprobs", req(beam_width=2, logprobs=1), INVALID, ["logprobs", "beam search"]),
    (
        "max-tokens-huge",
        req(max_tokens=2**32 - 1),
        INVALID,
        ["max_tokens", "max_model_len=512 minus the prompt's"],
    ),
    ("max-tokens-zero", req(max_tokens=0), INVALID, ["max_tokens", ">= 1"]),
    (
        "min-tokens-over-max-tokens",
        req(max_tokens=5, min_tokens=10),
        INVALID,
        ["min_tokens", "max_tokens=5"],
    ),
    (
        "too-many-stop-strings",
        req(stop=[f"s{i}" for i in range(17)]),
        INVALID,
        ["stop", "at most 16"],
    ),
    ("empty-stop-string", req(stop=[""]), INVALID, ["stop", "non-empty"]),
    ("stop-string-too-long", req(stop=["y" * 300]), INVALID, ["stop", "256 characters"]),
    (
        "stop-token-id-over-vocab",
        req(stop_token_ids=[VOCAB + 7]),
        INVALID,
        ["stop_token_ids", f"vocab_size={VOCAB}"],
    ),
    (
        "stop-token-ids-too-many",
        req(stop_token_ids=list(range(50_000))),
        INVALID,
        ["stop_token_ids", "<50000 ids>", "at most 128"],
    ),
    (
        "logprobs-over-limit",
        req(logprobs=50),
        INVALID,
        ["logprobs", "at most 20", "router.limits.max_logprobs"],
    ),
    ("seed-over-int63", req(seed=2**64 - 1), INVALID, ["seed", str(2**63 - 1)]),
    # identity and tenancy (auth is on: alice's token)
    (
        "request-id-too-long",
        req(request_id="r" * 200),
        INVALID,
        ["request_id", "at most 128 characters"],
    ),
    (
        "cache-salt-too-long",
        req(cache_salt="s" * 300),
        INVALID,
        ["cache_salt", "at most 256 characters"],
    ),
    (
        "unknown-tenant",
        req(tenant="mallory"),
        INVALID,
        ["tenant", "must match the bearer token's tenant"],
    ),
    ("other-tenant", req(tenant="bob"), INVALID, ["tenant", "must match"]),
]


def test_table_has_at_least_25_cases() -> None:
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.parametrize(
    ("data", "code", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_request(alice, data, code, needles) -> None:
    got, details = code_of(
        lambda: raw_generate(alice.channel, data, metadata=alice.metadata, timeout=CALL_TIMEOUT_S)
    )
    assert got == code, details
    for needle in needles:
        assert needle in details, (needle, details)
    assert "Traceback" not in details and "ray::" not in details  # no internals leak


@pytest.mark.ray
@pytest.mark.redis
def test_both_prompt_fields_follow_protobuf_oneof_rules(alice) -> None:
    """A message with text and then token_ids is, by protobuf's oneof rule, token_ids."""
    data = (
        raw_string_field(2, b"ignored text")
        + pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[3, 4, 5]), params=pb.SamplingParams(max_tokens=2)
        ).SerializeToString()
    )
    msgs = raw_generate(alice.channel, data, metadata=alice.metadata)
    assert msgs[-1].usage.prompt_tokens == 3


@pytest.mark.ray
@pytest.mark.redis
def test_chat_messages_are_rendered_with_the_model_template(alice) -> None:
    from worker.model.build_tiny import build_tiny_model
    from worker.model.tokenizer import Tokenizer

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = alice.generate(
        chat, max_tokens=2, temperature=0.0, ignore_eos=True, timeout=CALL_TIMEOUT_S
    )
    tok = Tokenizer.from_dir(build_tiny_model(family="llama"))
    rendered = tok.encode_chat(chat)
    assert tok.decode(rendered, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert out.prompt_tokens == len(rendered)
    assert out.completion_tokens == 2


@pytest.mark.ray
@pytest.mark.redis
def test_unary_and_tokenize_reject_malformed_bytes_too(alice) -> None:
    tokenize = alice.channel.unary_unary(
        "/kvcluster.v1.KVCluster/Tokenize",
        request_serializer=None,
        response_deserializer=pb.TokenizeResponse.FromString,
    )
    code, details = code_of(
        lambda: tokenize(
            raw_string_field(1, b"\xff"), metadata=alice.metadata, timeout=CALL_TIMEOUT_S
        )
    )
    assert code == INVALID and "text" in details and "UTF-8" in details
    unary = alice.channel.unary_unary(
        "/kvcluster.v1.KVCluster/GenerateUnary",
        request_serializer=None,
        response_deserializer=pb.GenerateResult.FromString,
    )
    code, details = code_of(
        lambda: unary(req(top_p=7.0), metadata=alice.metadata, timeout=CALL_TIMEOUT_S)
    )
    assert code == INVALID and "top_p" in details


@pytest.mark.ray
@pytest.mark.redis
def test_still_serving_after_the_abuse(secure, alice) -> None:
    out = alice.generate(
        "Still alive after all that?",
        max_tokens=4,
        temperature=0.0,
        ignore_eos=True,
        timeout=CALL_TIMEOUT_S,
    )
    assert out.completion_tokens == 4
    health = health_pb2_grpc.HealthStub(alice.channel)
    reply = health.Check(
        health_pb2.HealthCheckRequest(service="kvcluster.v1.KVCluster"), timeout=CALL_TIMEOUT_S
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert all(w.alive for w in alice.status().workers) and len(alice.status().workers) == 2
