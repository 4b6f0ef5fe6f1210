"""OpenAI's Responses API (``POST /v1/responses``) through the real HTTP server (uvicorn on
loopback, a scripted serving core) and the official ``openai`` client: the conversation the
model sees, the response object, its typed event stream as ``responses.stream`` assembles
it, function calls, and errors naming the field as this API spells it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai
import pytest

from kvstore.requests.outputs import (
    CompletionDelta,
    FinishReason,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from tests.router.edges import with_openai
from tests.router.http_api.test_http_hostile_bodies import Core as OneTokenCore
from tests.router.http_api.test_http_hostile_bodies import Tokenizer as OneTokenTokenizer

CHAT_IDS = [3, 4, 5]  # what the tokenizer renders any conversation to
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


class Core(OneTokenCore):
    """Answers with ``pieces`` (one output each), ending ``finish``; records each request."""

    def __init__(self, pieces: list[str], finish: FinishReason, fail_after: int | None) -> None:
        self.pieces, self.finish, self.fail_after = pieces, finish, fail_after
        self.params: list[Any] = []

    async def generate(self, request_id, token_ids, params, *, tenant=None, continue_from=()):  # noqa: ANN001, ANN201, E501
        self.params.append(params)
        for i, text in enumerate(self.pieces):
            if i == self.fail_after:
                raise RuntimeError("the worker died")
            last = i == len(self.pieces) - 1
            lps = None
            if params.logprobs is not None:  # token 7 + i at -0.5, then token 99 at -1.5
                lps = [TokenLogprob(7 + i, -0.5, ((7 + i, -0.5), (99, -1.5))[: params.logprobs])]
            finish = self.finish if last else None
            d = CompletionDelta(0, text, [7 + i], logprobs=lps, finish_reason=finish)
            yield "w0", RequestOutput(request_id, [d], last, Usage(len(token_ids), 1, i + 1))


class Tokenizer(OneTokenTokenizer):
    def __init__(self) -> None:
        self.chats: list[list[dict]] = []

    def encode_chat(self, messages: list, **options: object) -> list[int]:
        self.chats.append([dict(m) for m in messages])
        return list(CHAT_IDS)


def served(
    ask: Callable[[openai.OpenAI], Any],
    pieces: tuple[str, ...] = ("Hello", " world"),
    finish: FinishReason = FinishReason.STOP,
    fail_after: int | None = None,
) -> tuple[Any, Core, Tokenizer]:
    core, tok = Core(list(pieces), finish, fail_after), Tokenizer()
    return with_openai(core, tok, ask), core, tok


def test_a_whole_response_from_instructions_and_text_input() -> None:
    r, core, tok = served(
        lambda c: c.responses.create(model="m", input="hi", instructions="Be brief.")
    )
    assert tok.chats == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ]
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello world" and r.model == "m"
    (msg,) = r.output
    assert (msg.type, msg.role, msg.status) == ("message", "assistant", "completed")
    assert r.usage.input_tokens == 3 and r.usage.output_tokens == 2
    assert r.usage.input_tokens_details.cached_tokens == 1 and r.usage.total_tokens == 5
    # no max_output_tokens: as long as the context allows (512 here, less the prompt)
    assert core.params[0].max_tokens == 512 - len(CHAT_IDS)
    assert r.store is False and r.instructions == "Be brief."


def test_max_output_tokens_and_an_answer_it_cuts() -> None:
    r, core, _ = served(
        lambda c: c.responses.create(model="m", input="hi", max_output_tokens=2, temperature=0),
        finish=FinishReason.LENGTH,
    )
    assert core.params[0].max_tokens == 2 and core.params[0].temperature == 0
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.output_text == "Hello world"


def test_the_stream_is_assembled_by_the_client() -> None:
    def ask(c: openai.OpenAI) -> tuple[list, Any]:
        with c.responses.stream(model="m", input="hi") as stream:
            events = list(stream)
            return events, stream.get_final_response()

    (events, final), _, _ = served(ask, pieces=("He", "llo", " world"))
    kinds = [e.type for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "Hello world"
    )
    assert final.output_text == "Hello world" and final.status == "completed"
    assert final.usage.output_tokens == 3 and final.id == events[0].response.id


def test_input_items_become_the_conversation_with_its_calls() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather "},
                {"type": "input_text", "text": "in Paris?"},
            ],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {
            "type": "function_call",
            "call_id": "call_2",
            "name": "get_weather",
            "arguments": '{"city":"Lyon"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Sunny."}],
        },
        {"role": "user", "content": "Thanks"},
    ]
    _, _, tok = served(lambda c: c.responses.create(model="m", input=items, tools=[WEATHER]))
    (chat,) = tok.chats
    assert [m["role"] for m in chat] == [
        "developer",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
    ]
    assert chat[1]["content"] == "Weather in Paris?"
    calls = chat[2]["tool_calls"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("call_1", "get_weather", '{"city":"Paris"}'),
        ("call_2", "get_weather", '{"city":"Lyon"}'),
    ]
    assert (chat[3]["tool_call_id"], chat[3]["content"]) == ("call_1", "sunny")
    assert chat[5]["content"] == "Sunny."


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_is_an_output_item(stream: bool) -> None:
    def ask(c: openai.OpenAI) -> Any:
        if not stream:
            return c.responses.create(model="m", input="Weather?", tools=[WEATHER])
        with c.responses.stream(model="m", input="Weather?", tools=[WEATHER]) as s:
            deltas = [e for e in s if e.type == "response.output_text.delta"]
            assert deltas == []  # the call was held back, not sent as text
            return s.get_final_response()

    r, _, _ = served(ask, pieces=(CALL[:20], CALL[20:]))
    (call,) = r.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert r.output_text == "" and r.status == "completed"


def test_text_format_and_tool_choice_become_the_output_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def ask(c: openai.OpenAI) -> Any:
        c.responses.create(
            model="m",
            input="x",
            text={"format": {"type": "json_schema", "name": "t", "schema": schema}},
        )
        c.responses.create(
            model="m",
            input="x",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
        )
        c.responses.create(  # (a text object without a format: plain text, the tools')
            model="m", input="x", tools=[WEATHER], tool_choice="required", text={"verbosity": "low"}
        )
        return c.responses.create(model="m", input="x", text={"format": {"type": "json_object"}})

    r, core, _ = served(ask, pieces=('{"a": 1}',))
    kinds = [p.structured.kind for p in core.params]
    assert kinds == ["json_schema", "json_schema", "json_schema", "json_object"]
    assert json.loads(core.params[0].structured.value) == schema
    assert r.text.format.type == "json_object"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "file_search_call"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice.name",
        ),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": -1}, "temperature"),
    ],
)
def test_bad_requests_name_the_field_as_this_api_spells_it(body: dict, param: str) -> None:
    def ask(c: openai.OpenAI) -> Any:
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model="m", **body)
        return err.value

    err, core, _ = served(ask)
    assert err.body["param"] == param, err.body
    assert core.params == []  # refused before it reached a worker


def test_an_error_mid_stream_ends_it_failed() -> None:
    def ask(c: openai.OpenAI) -> list:
        with c.responses.stream(model="m", input="hi") as stream:
            return list(stream)

    events, _, _ = served(ask, pieces=("a", "b"), fail_after=1)
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-1].response.status == "failed" and events[-1].response.error.message


def test_the_response_id_is_the_servers_and_x_request_id_comes_back() -> None:
    def ask(c: openai.OpenAI) -> Any:
        return c.responses.with_raw_response.create(
            model="m", input="hi", extra_headers={"x-request-id": "mine"}
        )

    raw, _, _ = served(ask)
    assert raw.headers["x-request-id"] == "mine"
    r = raw.parse()
    assert r.id.startswith("resp_") and "mine" not in r.id  # (it keys a kept response)


def test_output_text_logprobs_when_included() -> None:
    include = ["message.output_text.logprobs"]

    def ask(c: openai.OpenAI) -> Any:
        plain = c.responses.create(model="m", input="hi", top_logprobs=2)  # not included
        whole = c.responses.create(model="m", input="hi", include=include, top_logprobs=2)
        with c.responses.stream(model="m", input="hi", include=include, top_logprobs=1) as s:
            deltas = [e.logprobs for e in s if e.type == "response.output_text.delta"]
            return plain, whole, deltas, s.get_final_response()

    (plain, whole, deltas, streamed), core, _ = served(ask)
    assert [p.logprobs for p in core.params] == [None, 2, 1]
    assert plain.output[0].content[0].logprobs == []
    lps = whole.output[0].content[0].logprobs
    assert [(x.token, x.logprob) for x in lps] == [("x", -0.5)] * 2  # (each token's text: "x")
    assert [[t.logprob for t in x.top_logprobs] for x in lps] == [[-0.5, -1.5]] * 2
    assert [[x.logprob for x in d] for d in deltas] == [[-0.5], [-0.5]]
    assert [len(x.top_logprobs) for x in streamed.output[0].content[0].logprobs] == [1, 1]


class WordTokenizer(Tokenizer):
    """One token per word of each message, plus two per message (its role and end)."""

    def encode_chat(self, messages: list, **options: object) -> list[int]:
        self.chats.append([dict(m) for m in messages])
        return self.ids(messages)

    @staticmethod
    def ids(messages: list) -> list[int]:
        return [7] * sum(len(m["content"].split()) + 2 for m in messages)


def test_truncation_auto_drops_the_oldest_turns_and_keeps_the_instructions() -> None:
    words = " ".join(["word"] * 100)  # 102 tokens a message
    items = []
    for turn in range(4):  # 4 turns of 204 tokens: 816, over the 512 of the context
        items += [
            {"role": "user", "content": f"q{turn} {words}"[:-5]},
            {"role": "assistant", "content": f"a{turn} {words}"[:-5]},
        ]
    items.append({"role": "user", "content": "And now?"})

    def ask(c: openai.OpenAI, **kw: Any) -> Any:
        return c.responses.create(model="m", input=items, instructions="Be brief.", **kw)

    core, tok = Core(["ok"], FinishReason.STOP, None), WordTokenizer()
    r = with_openai(core, tok, lambda c: ask(c, truncation="auto", max_output_tokens=50))
    assert r.status == "completed" and r.truncation == "auto"
    # the instructions, then the newest whole turns that fit in 512 - 50 tokens: 416 of them
    assert r.usage.input_tokens == 4 + 2 * 204 + 4
    (kept,) = [chat for chat in tok.chats if len(WordTokenizer.ids(chat)) == 416]
    assert kept[0] == {"role": "system", "content": "Be brief."}
    assert [m["content"].split()[0] for m in kept[1:]] == ["q2", "a2", "q3", "a3", "And"]
    assert core.params[-1].max_tokens == 50

    # without truncation, the whole conversation (which the serving core refuses)
    core, tok = Core(["ok"], FinishReason.STOP, None), WordTokenizer()
    r = with_openai(core, tok, lambda c: ask(c))
    assert r.usage.input_tokens == 4 + 4 * 204 + 4 and len(tok.chats) == 1

    # a last turn alone over the context: its last tokens, as before
    huge = [{"role": "user", "content": " ".join(["w"] * 600)}]
    core, tok = Core(["ok"], FinishReason.STOP, None), WordTokenizer()
    r = with_openai(
        core, tok, lambda c: c.responses.create(model="m", input=huge, truncation="auto")
    )
    assert r.status == "completed" and r.usage.input_tokens == 511
