"""A reasoning model's answers at the HTTP door (real uvicorn on loopback, a scripted serving
core, the official ``openai`` client): the chat's ``reasoning`` (and vLLM's older
``reasoning_content``) apart from the content, whole and streamed, with tools, from each
place the prompt leaves the output; ``reasoning_tokens`` in the usage; ``include_reasoning``;
``reasoning_effort``; earlier turns' reasoning in the conversation; the Responses API's
``reasoning`` item, whole and as typed events."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from tests.router.edges import with_openai
from tests.router.http_api.test_http_hostile_bodies import Core as OneTokenCore
from tests.router.http_api.test_http_hostile_bodies import Tokenizer as OneTokenTokenizer
from worker.model.reasoning_markers import ReasoningMarkers

START, END = 90, 91
MARKERS = ReasoningMarkers(START, END)
THOUGHT = ("<think>", "\nThe capital", " of France.", "\n", "</think>", "\n\nParis.")
CALL = '<tool_call>{"name": "capital", "arguments": {"country": "France"}}</tool_call>'
CAPITAL = {
    "type": "function",
    "function": {
        "name": "capital",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}}},
    },
}


class Core(OneTokenCore):
    """Answers with ``pieces``, one token and one output each (a marker's text: its id)."""

    def __init__(self, pieces: tuple[str, ...], finish: FinishReason) -> None:
        self.pieces, self.finish = pieces, finish
        self.params: list[Any] = []

    async def generate(self, request_id, token_ids, params, *, tenant=None, continue_from=()):  # noqa: ANN001, ANN201, E501
        self.params.append(params)
        for i, text in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            tok = {"<think>": START, "</think>": END}.get(text, 10 + i)
            d = CompletionDelta(0, text, [tok], finish_reason=self.finish if last else None)
            yield "w0", RequestOutput(request_id, [d], last, Usage(len(token_ids), 0, i + 1))


class Tokenizer(OneTokenTokenizer):
    """Renders any conversation to [3, 4, 5], the template's thinking switches added after:
    ``open_thinking`` opens the reasoning in the prompt (as DeepSeek-R1's template does),
    ``enable_thinking: false`` renders an empty one, closed (as Qwen3's)."""

    def __init__(self) -> None:
        self.chats: list[list[dict]] = []
        self.kwargs: list[dict] = []

    def encode_chat(self, messages: list, **options: Any) -> list[int]:
        self.chats.append([dict(m) for m in messages])
        kwargs = dict(options.get("template_kwargs") or {})
        self.kwargs.append(kwargs)
        ids = [3, 4, 5]
        if kwargs.get("open_thinking"):
            ids += [START, 6]
        if kwargs.get("enable_thinking") is False:
            ids += [START, 6, END, 6]
        return ids


def served(
    ask: Any,
    pieces: tuple[str, ...] = THOUGHT,
    finish: FinishReason = FinishReason.STOP,
    reasoning: ReasoningMarkers | None = MARKERS,
) -> tuple[Any, Core, Tokenizer]:
    core, tok = Core(pieces, finish), Tokenizer()
    return with_openai(core, tok, ask, reasoning=reasoning), core, tok


def chat(c: openai.OpenAI, **kw: Any) -> Any:
    return c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Capital of France?"}], **kw
    )


def streamed(c: openai.OpenAI, **kw: Any) -> tuple[str, str, list[Any]]:
    """(reasoning, content, chunks) of a streamed chat answer, as a client joins them."""
    chunks = list(chat(c, stream=True, **kw))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    older = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert older == reasoning
    return reasoning, "".join(d.content or "" for d in deltas), chunks


def test_a_whole_answer_has_its_reasoning_apart_and_counted() -> None:
    r, _, _ = served(lambda c: chat(c))
    msg = r.choices[0].message
    assert msg.content == "Paris."
    assert msg.model_extra["reasoning"] == "The capital of France."
    assert msg.model_extra["reasoning_content"] == "The capital of France."
    assert r.usage.completion_tokens == 6
    assert r.usage.completion_tokens_details.reasoning_tokens == 5  # <think> ... </think>
    assert r.choices[0].finish_reason == "stop"


def test_a_streamed_answer_reads_as_the_whole() -> None:
    (reasoning, content, chunks), _, _ = served(
        lambda c: streamed(c, stream_options={"include_usage": True})
    )
    assert (reasoning, content) == ("The capital of France.", "Paris.")
    first = chunks[0].choices[0].delta
    assert first.role == "assistant"
    # no piece of the reasoning is sent as content, nor a marker as either
    for ch in chunks:
        for choice in ch.choices:
            assert "think>" not in (choice.delta.content or "")
            assert "think>" not in ((choice.delta.model_extra or {}).get("reasoning") or "")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 5
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


def test_a_template_that_opens_the_reasoning_in_the_prompt() -> None:
    pieces = ("Hmm", ", 2 + 2", "\n", "</think>", "\n\n4")
    kw = {"extra_body": {"chat_template_kwargs": {"open_thinking": True}}}
    r, _, _ = served(lambda c: chat(c, **kw), pieces=pieces)
    assert r.choices[0].message.model_extra["reasoning"] == "Hmm, 2 + 2"
    assert r.choices[0].message.content == "4"
    assert r.usage.completion_tokens_details.reasoning_tokens == 4
    (reasoning, content, _), _, _ = served(lambda c: streamed(c, **kw), pieces=pieces)
    assert (reasoning, content) == ("Hmm, 2 + 2", "4")


def test_an_answer_cut_while_reasoning_is_all_reasoning() -> None:
    r, _, _ = served(
        lambda c: chat(c, max_tokens=3), pieces=THOUGHT[:3], finish=FinishReason.LENGTH
    )
    msg = r.choices[0].message
    assert msg.model_extra["reasoning"] == "The capital of France."
    assert msg.content == "" and r.choices[0].finish_reason == "length"


def test_thinking_switched_off_leaves_the_answer_whole() -> None:
    """A prompt that closed the reasoning (Qwen3's enable_thinking: false): no split."""
    pieces = ("Paris <think>", "x</think>")
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    r, _, tok = served(lambda c: chat(c, **kw), pieces=pieces)
    assert r.choices[0].message.content == "Paris <think>x</think>"
    assert r.choices[0].message.model_extra["reasoning"] is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert tok.kwargs == [{"enable_thinking": False}]


def test_an_answer_that_does_not_reason_is_plain_content() -> None:
    r, _, _ = served(lambda c: chat(c), pieces=("Paris", "."))
    msg = r.choices[0].message
    assert msg.content == "Paris." and msg.model_extra["reasoning"] is None
    (reasoning, content, _), _, _ = served(lambda c: streamed(c), pieces=("Paris", "."))
    assert (reasoning, content) == ("", "Paris.")


def test_include_reasoning_false_drops_it() -> None:
    kw = {"extra_body": {"include_reasoning": False}}
    r, _, _ = served(lambda c: chat(c, **kw))
    msg = r.choices[0].message
    assert msg.content == "Paris." and msg.model_extra["reasoning"] is None
    (reasoning, content, _), _, _ = served(lambda c: streamed(c, **kw))
    assert (reasoning, content) == ("", "Paris.")


def test_a_model_without_markers_answers_its_text_as_it_is() -> None:
    r, _, _ = served(lambda c: chat(c), reasoning=None)
    msg = r.choices[0].message
    assert msg.content == "".join(THOUGHT) and "reasoning" not in (msg.model_extra or {})
    assert r.usage.completion_tokens_details is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_after_the_reasoning(stream: bool) -> None:
    pieces = ("<think>", "I should call it.", "</think>", "\n", CALL[:25], CALL[25:])

    def ask(c: openai.OpenAI) -> tuple[str, str, list[dict]]:
        if not stream:
            msg = chat(c, tools=[CAPITAL]).choices[0].message
            calls = [json.loads(t.function.arguments) for t in msg.tool_calls]
            return msg.model_extra["reasoning"], msg.content or "", calls
        reasoning, content, chunks = streamed(c, tools=[CAPITAL])
        calls = [
            json.loads(t.function.arguments)
            for ch in chunks
            for t in (ch.choices[0].delta.tool_calls or [] if ch.choices else [])
        ]
        return reasoning, content, calls

    (reasoning, content, calls), _, _ = served(ask, pieces=pieces)
    assert reasoning == "I should call it."
    assert content == "" and calls == [{"country": "France"}]


def test_earlier_turns_reasoning_reaches_the_template() -> None:
    messages = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning": "It is Paris."},
        {"role": "user", "content": "And Italy?"},
        {"role": "assistant", "content": "Rome.", "reasoning_content": "It is Rome."},
        {"role": "user", "content": "Spain?"},
    ]
    _, _, tok = served(lambda c: c.chat.completions.create(model="m", messages=messages))
    (rendered,) = tok.chats
    assert rendered[1]["reasoning_content"] == "It is Paris."
    assert rendered[3]["reasoning_content"] == "It is Rome."
    assert "reasoning" not in rendered[1] and "reasoning_content" not in rendered[0]


def test_reasoning_effort_goes_to_the_template_and_bad_values_name_the_field() -> None:
    _, _, tok = served(lambda c: chat(c, reasoning_effort="low"))
    assert tok.kwargs == [{"reasoning_effort": "low"}]

    def bad(c: openai.OpenAI, **kw: Any) -> str:
        with pytest.raises(openai.BadRequestError) as err:
            chat(c, **kw)
        return err.value.body["param"] + ": " + err.value.body["message"]

    message, _, _ = served(lambda c: bad(c, extra_body={"reasoning_effort": "max"}))
    assert message.startswith("reasoning_effort:") and "high" in message
    bad_turn = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x", "reasoning": ["not", "text"]},
        {"role": "user", "content": "hi"},
    ]
    message, _, _ = served(lambda c: bad(c, extra_body={"messages": bad_turn}))
    assert message.startswith("messages[1].reasoning")
    user_turn = [{"role": "user", "content": "hi", "reasoning": "a user does not reason"}]
    message, _, _ = served(lambda c: bad(c, extra_body={"messages": user_turn}))
    assert message.startswith("messages[0]") and "unknown message field" in message


def test_a_responses_answer_has_a_reasoning_item_first() -> None:
    r, _, tok = served(
        lambda c: c.responses.create(model="m", input="Capital?", reasoning={"effort": "high"})
    )
    thought, msg = r.output
    assert (thought.type, thought.status, thought.summary) == ("reasoning", "completed", [])
    assert [p.text for p in thought.content] == ["The capital of France."]
    assert thought.id.startswith("rs_")
    assert msg.type == "message" and r.output_text == "Paris."
    assert r.usage.output_tokens_details.reasoning_tokens == 5
    assert r.reasoning.effort == "high" and tok.kwargs == [{"reasoning_effort": "high"}]


def test_a_streamed_responses_answer_is_assembled_as_the_whole() -> None:
    def ask(c: openai.OpenAI) -> tuple[list, Any]:
        with c.responses.stream(model="m", input="Capital?") as stream:
            return list(stream), stream.get_final_response()

    (events, final), _, _ = served(ask)
    whole, _, _ = served(lambda c: c.responses.create(model="m", input="Capital?"))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "The capital of France."
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    assert [e.sequence_number for e in events] == list(range(len(events)))

    def items(r: Any) -> list[dict]:
        """The output items but their ids (and the client's own ``parsed`` field)."""
        out = []
        for o in r.output:
            item = {k: v for k, v in o.to_dict().items() if k != "id"}
            item["content"] = [
                {k: v for k, v in p.items() if k != "parsed"} for p in item["content"]
            ]
            out.append(item)
        return out

    assert items(final) == items(whole) and len(items(whole)) == 2
    assert final.usage.output_tokens_details.reasoning_tokens == 5


def test_a_responses_answer_with_a_call_after_the_reasoning() -> None:
    tool = {"type": "function", "name": "capital", "parameters": CAPITAL["function"]["parameters"]}
    pieces = ("<think>", "Call it.", "</think>", CALL)
    r, _, _ = served(
        lambda c: c.responses.create(model="m", input="Capital?", tools=[tool]), pieces=pieces
    )
    thought, call = r.output
    assert thought.type == "reasoning" and thought.content[0].text == "Call it."
    assert call.type == "function_call" and json.loads(call.arguments) == {"country": "France"}


def test_responses_reasoning_items_go_with_their_answers() -> None:
    """An agent loop sends its earlier reasoning back: it reaches the template with the
    assistant turn it preceded (Qwen3's shows a tool loop's reasoning)."""
    items = [
        {"role": "user", "content": "Capital of France?"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Look it up."}],
        },
        {"type": "function_call", "call_id": "c1", "name": "capital", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Paris"},
        {
            "type": "reasoning",
            "id": "rs_2",
            "summary": [{"type": "summary_text", "text": "Got it."}],
        },
        {"role": "assistant", "content": "Paris."},
        {"type": "reasoning", "id": "rs_3", "summary": []},  # (nothing to carry)
        {"role": "user", "content": "Thanks"},
    ]
    _, _, tok = served(lambda c: c.responses.create(model="m", input=items))
    (chat,) = tok.chats
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "assistant", "user"]
    assert chat[1]["reasoning_content"] == "Look it up." and chat[1]["tool_calls"]
    assert chat[3]["reasoning_content"] == "Got it."
    assert "reasoning_content" not in chat[0] and "reasoning_content" not in chat[4]

    bad = [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text"}]}, items[0]]

    def refused(c: openai.OpenAI) -> Any:
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model="m", input=bad)
        return err.value.body

    body, _, _ = served(refused)
    assert body["param"] == "input[0].content[0]"
