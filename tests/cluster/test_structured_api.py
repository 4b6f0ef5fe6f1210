"""Structured outputs and tool calls on a real cluster (local Ray, redis-server, the tiny
random model): the official ``openai`` client (``chat.completions.parse`` with a pydantic
model, streams it assembles), the gRPC field, and the 400s naming the field.

A random-weight model says nothing sensible, so every output here is what the grammar made
of noise: if it parses and validates, the constraint held. Schemas bound their strings and
arrays so any model ends within max_tokens."""

from __future__ import annotations

import json
import os
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from cluster.client import KVClusterClient, build_request
from cluster.launcher import Cluster
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from tests.cluster.conftest import ENGINE, cluster_config
from tests.embedded_ray import shared_ray

pytestmark = [pytest.mark.ray, pytest.mark.redis]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=30)
    tags: list[Literal["cute", "old"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    """One worker with room for tool prompts (the tiny model's 8k vocabulary spends about
    200 tokens on the tools prompt and 180 per tool)."""
    engine = {**ENGINE, "max_model_len": 1024, "num_blocks": 256}
    shared_ray()  # every cluster of the session on one Ray
    with Cluster(
        cluster_config(f"structured-{os.getpid()}", workers={"num_workers": 1, "engine": engine})
    ) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> KVClusterClient:
    with KVClusterClient(cluster.endpoints[0]) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(api_key="none", base_url=cluster.http_endpoints[0] + "/v1", timeout=120)


@pytest.fixture(scope="module")
def model(cluster) -> str:  # noqa: ANN001
    return cluster.model_id


def test_openai_parse_with_a_pydantic_model(oai, model) -> None:  # noqa: ANN001
    done = oai.chat.completions.parse(
        model=model, messages=ASK, response_format=Pet, max_tokens=96, temperature=0.8, seed=1
    )
    pet = done.choices[0].message.parsed
    assert isinstance(pet, Pet), done.choices[0].message.content
    assert done.choices[0].finish_reason == "stop"


def test_json_schema_streamed_and_whole_validate(oai, model) -> None:  # noqa: ANN001
    schema = Pet.model_json_schema()  # (no additionalProperties: strict mode forbids them)
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    strict = {**schema, "additionalProperties": False}
    whole = oai.chat.completions.create(
        model=model, messages=ASK, response_format=fmt, max_tokens=96, n=2, temperature=1.0
    )
    for choice in whole.choices:
        jsonschema.validate(json.loads(choice.message.content), strict)
    stream = oai.chat.completions.create(
        model=model, messages=ASK, response_format=fmt, max_tokens=96, stream=True, seed=3
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), strict)
    obj = oai.chat.completions.create(
        model=model, messages=ASK, response_format={"type": "json_object"}, max_tokens=8
    )
    assert obj.choices[0].message.content.startswith("{")  # (8 tokens: rarely closed)


def test_vllm_extras_on_completions(oai, model) -> None:  # noqa: ANN001
    choice = oai.completions.create(
        model=model, prompt="Pick:", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert choice.choices[0].text in ("yes", "no")
    regex = oai.completions.create(
        model=model,
        prompt="Code:",
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
    )
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.choices[0].text)


def test_bad_constraints_are_400s_naming_the_field(oai, model) -> None:  # noqa: ANN001
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "florp"}}}
    cases = [
        ({"response_format": bad}, "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        (
            {"extra_body": {"guided_grammar": "start: " + "|".join(['"a"'] * 30000)}},
            "guided_grammar",
        ),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=model, messages=ASK, max_tokens=4, **kwargs)
        assert field in str(err.value), (field, err.value)
    ok = oai.chat.completions.create(model=model, messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"  # the cluster serves on


def test_tool_choice_required_and_named_always_call(oai, model) -> None:  # noqa: ANN001
    params = WEATHER["function"]["parameters"]
    for i in range(3):
        r = oai.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            max_tokens=96,
            temperature=1.0,
            seed=i,
        )
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0].message
        for call in calls:
            assert call.function.name in ("get_weather", "get_time")
            args = json.loads(call.function.arguments)
            tool = WEATHER if call.function.name == "get_weather" else CLOCK
            jsonschema.validate(args, tool["function"]["parameters"])
    named = oai.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params)


def test_streamed_tool_call_is_assembled_by_the_client(oai, model) -> None:  # noqa: ANN001
    with oai.chat.completions.stream(
        model=model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=96,
        parallel_tool_calls=False,
    ) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the call and its result go back into the history; the model answers the next turn
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    nxt = oai.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert nxt.choices[0].message.tool_calls is None and nxt.usage.prompt_tokens > 60


def test_grpc_structured_field(client) -> None:  # noqa: ANN001
    req = build_request(
        "Answer:", max_tokens=24, structured=pb.StructuredOutputs(regex="(ab|cd){2,3}!")
    )
    out = client.generate("Answer:", max_tokens=24, structured=req.params.structured)
    assert re.fullmatch("(ab|cd){2,3}!", out.text), out.text
