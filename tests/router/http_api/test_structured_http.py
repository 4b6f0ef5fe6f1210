"""The HTTP edge's structured-output and tool fields: every spelling to the API's field, the
400s naming the client's field, tool-call parsing of each style, the stream's hold-back of
text that may be a call, and tools through chat templates that take them and that do not."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import tokenizers

from kvstore.requests.errors import InvalidRequest
from router.edge.convert import spec_from_pb
from router.http_api.openai_request import parse_request
from router.http_api.tool_calls import ToolStream, parse_calls, tool_chunk_delta
from router.placement.config import RequestLimits
from worker.model.build_tiny import build_tiny_model
from worker.model.tokenizer import Tokenizer

LIMITS = RequestLimits()
ASK = [{"role": "user", "content": "Weather in Rome?"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def chat(**body):  # noqa: ANN003, ANN201
    """The parsed request, its grammars compile-checked as the intake checks them."""
    meta, specs = parse_request(
        {"model": "m", "messages": ASK, **body}, chat=True, tenant=None, limits=LIMITS, now=0
    )
    for grammar in specs[0].grammars:
        grammar.check()
    return meta, specs


def structured(**body):  # noqa: ANN003, ANN201
    _, specs = chat(**body)
    return specs[0].params.structured


def test_every_spelling_reaches_the_engine_field() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    s = structured(response_format=fmt)
    assert (s.kind, json.loads(s.value)) == ("json_schema", schema)
    assert structured(response_format={"type": "json_object"}).kind == "json_object"
    assert structured(response_format={"type": "text"}) is None
    assert structured(guided_json=json.dumps(schema)).kind == "json_schema"
    assert structured(guided_regex="a+b").value == "a+b"
    assert json.loads(structured(guided_choice=["x", "y"]).value) == ["x", "y"]
    assert structured(guided_grammar='root ::= "a"').kind == "grammar"
    assert structured(structured_outputs={"regex": "[0-9]+"}).value == "[0-9]+"
    assert structured(structured_outputs={"json_object": True}).kind == "json_object"
    strict = {**fmt, "json_schema": {**fmt["json_schema"], "strict": True}}
    assert json.loads(structured(response_format=strict).value)["additionalProperties"] is False
    _, specs = parse_request(
        {"model": "m", "prompt": "x", "guided_choice": ["a"]},
        chat=False,
        tenant=None,
        limits=LIMITS,
        now=0,
    )
    assert json.loads(specs[0].params.structured.value) == ["a"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_grammar": "x" * 70000}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"},
            "tool_choice",
        ),
    ],
)
def test_bad_input_names_the_field(body: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        chat(**body)
    assert err.value.field == field, err.value


def test_required_and_named_tool_choice_are_grammars() -> None:
    meta, specs = chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(specs[0].params.structured.value)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {
        "const": "get_weather"
    }
    assert meta.tools.choice == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, specs = chat(tools=[TOOL], tool_choice=named)
    assert json.loads(specs[0].params.structured.value) == TOOL["function"]["parameters"]
    _, specs = chat(tools=[TOOL])  # auto: the model decides, no grammar
    assert specs[0].params.structured is None and specs[0].chat.tools == (TOOL,)


def test_tool_calls_of_each_style_are_parsed() -> None:
    meta, _ = chat(tools=[TOOL])
    auto = meta.tools
    call = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    hermes = f"Let me look.\n<tool_call>\n{call}\n</tool_call>"
    content, calls = parse_calls(hermes, auto)
    assert content == "Let me look." and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    a, b = (json.dumps({"name": "get_weather", "parameters": {"city": c}}) for c in "AB")
    llama = f"<|python_tag|>{a}; {b}"
    content, calls = parse_calls(llama, auto)
    assert content is None and [json.loads(c["function"]["arguments"])["city"] for c in calls] == [
        "A",
        "B",
    ]
    assert parse_calls('{"name": "unknown_tool", "arguments": {}}', auto)[1] == []
    assert parse_calls("<tool_call>not json</tool_call>", auto)[1] == []
    assert parse_calls("It is sunny.", auto) == ("It is sunny.", [])
    assert parse_calls(hermes, replace(auto, choice="none")) == (hermes, [])
    required = replace(auto, choice="required")
    assert len(parse_calls('[{"name":"get_weather","arguments":{"city":"X"}}]', required)[1]) == 1
    named = replace(auto, choice="function", function="get_weather")
    assert parse_calls('{"city":"X"}', named)[1][0]["function"]["arguments"] == '{"city":"X"}'


def test_stream_holds_back_what_may_be_a_call() -> None:
    meta, _ = chat(tools=[TOOL])
    stream = ToolStream(meta.tools)
    pieces = [
        "Sure",
        ", checking <",
        "tool",
        "_call>\n{",
        '"name": "get_weather", "arguments"',
        ': {"city": "Oslo"}}\n</tool_call>',
    ]
    sent = [stream.feed(p) for p in pieces[:-1]]
    assert "".join(sent) == "Sure, checking "
    delta, reason = tool_chunk_delta(stream, pieces[-1], "stop")
    assert reason == "tool_calls" and delta["content"] is None
    (call,) = delta["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    plain = ToolStream(meta.tools)
    assert plain.feed("a < b") == "a < b" and plain.feed(" and <t") == " and "
    delta, reason = tool_chunk_delta(plain, "ea>", "stop")
    assert (delta["content"], reason) == ("<tea>", "stop")


def test_tools_through_templates_with_and_without_tool_support() -> None:
    backend = tokenizers.Tokenizer.from_str(Tokenizer.from_dir(build_tiny_model()).backend_json())
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
    ]
    native = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}\n"
        "{% endfor %}"
    )
    text = Tokenizer(backend, chat_template=native).render_chat(history, tools=[TOOL])
    assert text.startswith("TOOL get_weather\n") and "CALL get_weather Rome" in text
    assert "[tool]21 C" in text
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    text = Tokenizer(backend, chat_template=chatml).render_chat(history, tools=[TOOL])
    assert text.startswith("<|im_start|>system\nYou may call functions")
    assert '"name":"get_weather"' in text and "<tool_response>\n21 C\n</tool_response>" in text
    assert '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>' in text


def test_grpc_field_is_checked_and_named() -> None:
    from protos.kvcluster.v1 import kvcluster_pb2 as pb

    req = pb.GenerateRequest(text="hi")
    req.params.structured.regex = "[a-z]+"
    assert spec_from_pb(req).params.structured.value == "[a-z]+"
    req.params.structured.regex = "[a-z"
    (grammar,) = spec_from_pb(req).grammars  # compile-checked by the intake, off the loop
    with pytest.raises(InvalidRequest) as err:
        grammar.check()
    assert err.value.field == "params.structured.regex"
    req.params.structured.json_schema = "{not json"
    with pytest.raises(InvalidRequest, match="not JSON"):
        spec_from_pb(req)
    req.params.beam_width = 2
    req.params.structured.json_object = True
    with pytest.raises(InvalidRequest, match="beam search cannot be combined"):
        spec_from_pb(req)
