"""SamplingParams is the one declaration of the sampling fields (its ``Wire`` metadata): the
proto's fields, the gRPC conversion and the OpenAI field list follow from it. These tests fail
when a field is on one side only, or is taken and then dropped. Exclusions are explicit and
say why."""

from __future__ import annotations

import pytest

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.sampling_params import DEFAULTS, WIRE
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.edge.convert import PARAMS_FIELDS, REQUEST_FIELDS, spec_from_pb
from router.http_api import openai_request
from router.http_api.openai_request import CHAT_FIELDS, COMPLETION_FIELDS, parse_request
from router.placement.config import RequestLimits
from router.serving.generate_spec import tenant_salt

LIMITS = RequestLimits()

# Request fields of the OpenAI API that are not sampling fields: the prompt, the answer's
# shape and id, and fields that do not change the output.
HTTP_REQUEST_FIELDS = {
    "prompt",  # completions
    "messages",  # chat
    "suffix",  # refused unless null
    "echo",  # completions: the prompt before its completion
    "stream",
    "stream_options",
    "request_id",
    "best_of",  # refused unless equal to n
    "truncate_prompt_tokens",  # cuts the prompt (GenerateSpec), not the sampling
    "return_tokens_as_token_ids",  # how tokens are shown
    "return_token_ids",  # the answer carries token ids
    "use_beam_search",  # refused unless false (see WIRE["beam_width"].note)
    "length_penalty",  # refused unless null or 1
    "early_stopping",  # refused unless null or false
    "user",  # no effect on the output
    "store",
    "metadata",
    "service_tier",
    "chat_template_kwargs",  # chat: how the prompt is rendered
    "add_generation_prompt",
    "continue_final_message",
    "tools",  # chat: rendered into the prompt, and tool_choice's grammar
    "tool_choice",
    "parallel_tool_calls",
    "functions",  # refused (the deprecated spelling of tools)
    "function_call",
    "include_reasoning",  # chat: a reasoning model's reasoning answered apart, or dropped
    "reasoning_effort",  # chat: a chat template variable
}


def test_every_proto_sampling_field_is_declared() -> None:
    proto = set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert proto == set(PARAMS_FIELDS), (
        "pb.SamplingParams and SamplingParams' Wire metadata disagree: "
        f"proto only {sorted(proto - set(PARAMS_FIELDS))}, "
        f"declared only {sorted(set(PARAMS_FIELDS) - proto)}"
    )
    request = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    for proto_name in REQUEST_FIELDS:
        assert proto_name in request, f"GenerateRequest has no field {proto_name}"


def test_every_declared_field_is_on_both_apis_or_says_why() -> None:
    for name, wire in WIRE.items():
        if wire.proto is None or not wire.openai:
            assert wire.note, f"SamplingParams.{name} is missing from an API without a note"
    assert set(WIRE) == set(DEFAULTS)


def test_every_openai_name_is_a_known_field_and_every_known_field_is_declared() -> None:
    for name, wire in WIRE.items():
        for openai in wire.openai:
            assert openai in COMPLETION_FIELDS and openai in CHAT_FIELDS, (name, openai)
        for openai in wire.chat:
            assert openai in CHAT_FIELDS and openai not in COMPLETION_FIELDS, (name, openai)
    sampling = {n for w in WIRE.values() for n in (*w.openai, *w.chat)}
    undeclared = (CHAT_FIELDS | COMPLETION_FIELDS) - sampling - HTTP_REQUEST_FIELDS
    assert not undeclared, f"HTTP fields neither sampling fields nor listed here: {undeclared}"


# One non-default value per proto field, and what SamplingParams holds for it. A new proto
# field fails test_every_proto_field_is_honoured until it is added here.
PROTO_VALUES = {
    "max_tokens": (5, 5),
    "min_tokens": (2, 2),
    "temperature": (0.5, 0.5),
    "top_k": (3, 3),
    "top_p": (0.5, 0.5),
    "min_p": (0.25, 0.25),
    "seed": (7, 7),
    "n": (2, 2),
    "beam_width": (2, 2),
    "length_penalty": (0.5, 0.5),
    "stop": (["x"], ("x",)),
    "stop_token_ids": ([5], (5,)),
    "ignore_eos": (True, True),
    "logprobs": (2, 2),
    "presence_penalty": (0.5, 0.5),
    "frequency_penalty": (0.5, 0.5),
    "repetition_penalty": (1.5, 1.5),
    "structured": (pb.StructuredOutputs(regex="a+"), "regex"),  # (its kind)
    "early_stopping": (pb.EARLY_STOPPING_NEVER, "never"),
    "include_stop_str_in_output": (True, True),
    "skip_special_tokens": (False, False),
    "prompt_logprobs": (1, 1),
    "logit_bias": ({5: 2.0}, ((5, 2.0),)),
    "allowed_token_ids": ([5, 9], (5, 9)),
    "bad_words": (["no"], ("no",)),
}


@pytest.mark.parametrize("proto_name", sorted(PARAMS_FIELDS))
def test_every_proto_field_is_honoured(proto_name: str) -> None:
    assert proto_name in PROTO_VALUES, f"add params.{proto_name} to PROTO_VALUES"
    value, expected = PROTO_VALUES[proto_name]
    spec = spec_from_pb(pb.GenerateRequest(text="x", params={proto_name: value}))
    got = getattr(spec.params, PARAMS_FIELDS[proto_name])
    if proto_name == "structured":
        got = got.kind
    assert got == expected != DEFAULTS[PARAMS_FIELDS[proto_name]]


def test_request_level_proto_fields_are_honoured() -> None:
    req = pb.GenerateRequest(text="x", priority=3, cache_salt="s", lora="adapter")
    params = spec_from_pb(req).params
    assert (params.priority, params.cache_salt, params.lora) == (
        3,
        tenant_salt(None, "s"),
        "adapter",
    )
    assert set(REQUEST_FIELDS) == {"priority", "cache_salt", "lora"}


# One non-default value per OpenAI name (chat-only names with their companions), and the
# SamplingParams field and value it sets. A new name fails the test until it is added here.
HTTP_VALUES: dict[str, tuple[dict, str, object]] = {
    "max_tokens": ({"max_tokens": 5}, "max_tokens", 5),
    "max_completion_tokens": ({"max_completion_tokens": 5}, "max_tokens", 5),
    "min_tokens": ({"min_tokens": 2}, "min_tokens", 2),
    "temperature": ({"temperature": 0.5}, "temperature", 0.5),
    "top_k": ({"top_k": 3}, "top_k", 3),
    "top_p": ({"top_p": 0.5}, "top_p", 0.5),
    "min_p": ({"min_p": 0.25}, "min_p", 0.25),
    "presence_penalty": ({"presence_penalty": 0.5}, "presence_penalty", 0.5),
    "frequency_penalty": ({"frequency_penalty": 0.5}, "frequency_penalty", 0.5),
    "repetition_penalty": ({"repetition_penalty": 1.5}, "repetition_penalty", 1.5),
    "seed": ({"seed": 7}, "seed", 7),
    "n": ({"n": 2}, "n", 2),
    "stop": ({"stop": "x"}, "stop", ("x",)),
    "stop_token_ids": ({"stop_token_ids": [5]}, "stop_token_ids", (5,)),
    "ignore_eos": ({"ignore_eos": True}, "ignore_eos", True),
    "include_stop_str_in_output": (
        {"include_stop_str_in_output": True},
        "include_stop_str_in_output",
        True,
    ),
    "logprobs": ({"logprobs": 2}, "logprobs", 2),  # completions: an integer
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, "logprobs", 2),
    "prompt_logprobs": ({"prompt_logprobs": 1}, "prompt_logprobs", 1),
    "priority": ({"priority": 3}, "priority", 3),
    "cache_salt": ({"cache_salt": "s"}, "cache_salt", tenant_salt(None, "s")),
    "skip_special_tokens": ({"skip_special_tokens": False}, "skip_special_tokens", False),
    "logit_bias": ({"logit_bias": {"5": 2}}, "logit_bias", ((5, 2.0),)),
    "allowed_token_ids": ({"allowed_token_ids": [5, 9]}, "allowed_token_ids", (5, 9)),
    "bad_words": ({"bad_words": ["no", "never"]}, "bad_words", ("no", "never")),
    "response_format": ({"response_format": {"type": "json_object"}}, "structured", "json_object"),
    "structured_outputs": ({"structured_outputs": {"regex": "a+"}}, "structured", "regex"),
    "guided_json": ({"guided_json": {"type": "object"}}, "structured", "json_schema"),
    "guided_regex": ({"guided_regex": "a+"}, "structured", "regex"),
    "guided_choice": ({"guided_choice": ["a", "b"]}, "structured", "choice"),
    "guided_grammar": ({"guided_grammar": 'root ::= "a"'}, "structured", "grammar"),
}
# OpenAI names whose effect parse_request cannot show, and where it is tested instead
HTTP_ELSEWHERE = {
    "model": "names the LoRA adapter, resolved by the intake (tests/cluster/test_lora_routing.py)",
}


@pytest.mark.parametrize(
    "name", sorted(openai_request.SAMPLING_FIELDS | openai_request.SAMPLING_CHAT_FIELDS)
)
def test_every_openai_sampling_field_is_honoured(name: str) -> None:
    if name in HTTP_ELSEWHERE:
        return
    assert name in HTTP_VALUES, f"add {name} to HTTP_VALUES"
    body, field, expected = HTTP_VALUES[name]
    chat = name in openai_request.SAMPLING_CHAT_FIELDS
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    _, (spec,) = parse_request({**prompt, **body}, chat=chat, tenant=None, limits=LIMITS, now=0)
    got = getattr(spec.params, field)
    if field == "structured":
        got = got.kind
    assert got == expected != DEFAULTS[field]


@pytest.mark.parametrize(
    "field, value",
    [("use_beam_search", True), ("length_penalty", 2.0), ("early_stopping", "never")],
)
def test_beam_search_fields_are_refused_over_http(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_request({"prompt": "hi", field: value}, chat=False, tenant=None, limits=LIMITS, now=0)
    assert err.value.field == field and "gRPC" in str(err.value)
    # their "off" values are accepted
    off = {"use_beam_search": False, "length_penalty": 1, "early_stopping": False}[field]
    parse_request({"prompt": "hi", field: off}, chat=False, tenant=None, limits=LIMITS, now=0)


def test_a_message_authors_name_reaches_the_template_on_both_apis() -> None:
    _, (spec,) = parse_request(
        {"messages": [{"role": "user", "content": "hi", "name": "ann"}]},
        chat=True,
        tenant=None,
        limits=LIMITS,
        now=0,
    )
    assert spec.messages[0]["name"] == "ann" and spec.chat.rendered_chars == 3
    msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi", name="ann")])
    spec = spec_from_pb(pb.GenerateRequest(messages=msgs))
    assert spec.messages[0]["name"] == "ann" and spec.chat.rendered_chars == 3
