"""vLLM's ``return_token_ids`` through the real HTTP server (uvicorn on loopback, a small
serving core) and the official ``openai`` client: the answer carries the prompt's token ids
and each choice's generated ones, whole and streamed, on completions and chat."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai

from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from tests.router.edges import with_openai
from tests.router.http_api.test_http_hostile_bodies import Core as OneTokenCore
from tests.router.http_api.test_http_hostile_bodies import Tokenizer as OneTokenTokenizer

CHAT_IDS = [3, 4, 5]  # what the tokenizer renders any conversation to


class Core(OneTokenCore):
    """Answers each of ``n`` samples with token 7 ("a"), then tokens 8, 9 ("bc")."""

    async def generate(self, request_id, token_ids, params, *, tenant=None, continue_from=()):  # noqa: ANN001, ANN201, E501
        first = [CompletionDelta(i, "a", [7]) for i in range(params.n)]
        yield "w0", RequestOutput(request_id, first, False, Usage(len(token_ids), 0, params.n))
        last = [
            CompletionDelta(i, "bc", [8, 9], finish_reason=FinishReason.STOP)
            for i in range(params.n)
        ]
        yield "w0", RequestOutput(request_id, last, True, Usage(len(token_ids), 0, 3 * params.n))


class Tokenizer(OneTokenTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") + 1 for c in text]  # "abc" -> [1, 2, 3]

    def encode_chat(self, messages: list, **options: object) -> list[int]:
        return list(CHAT_IDS)


def with_client(ask: Callable[[openai.OpenAI], Any]) -> Any:
    return with_openai(Core(), Tokenizer(), ask)


ON = {"extra_body": {"return_token_ids": True}}


def test_completions_whole() -> None:
    def ask(c: openai.OpenAI) -> dict:
        return c.completions.create(model="m", prompt="cab", n=2, **ON).model_dump()

    answer = with_client(ask)
    for i, choice in enumerate(answer["choices"]):
        assert (choice["index"], choice["text"]) == (i, "abc")
        assert choice["token_ids"] == [7, 8, 9]
        assert choice["prompt_token_ids"] == [3, 1, 2]


def test_completions_streamed_and_per_prompt() -> None:
    def ask(c: openai.OpenAI) -> list[dict]:
        stream = c.completions.create(model="m", prompt=["ab", "c"], stream=True, **ON)
        return [chunk.model_dump() for chunk in stream]

    chunks = with_client(ask)
    per_choice: dict[int, list[dict]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        per_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(per_choice) == [0, 1]
    for index, prompt_ids in ((0, [1, 2]), (1, [3])):
        first, last = per_choice[index]
        assert (first["token_ids"], last["token_ids"]) == ([7], [8, 9])  # each chunk's new ids
        assert first["prompt_token_ids"] == prompt_ids  # on the first chunk only
        assert last.get("prompt_token_ids") is None


def test_chat_whole() -> None:
    def ask(c: openai.OpenAI) -> dict:
        messages = [{"role": "user", "content": "hi"}]
        return c.chat.completions.create(model="m", messages=messages, **ON).model_dump()

    answer = with_client(ask)
    assert answer["prompt_token_ids"] == CHAT_IDS  # on the answer (one prompt)
    (choice,) = answer["choices"]
    assert choice["message"]["content"] == "abc" and choice["token_ids"] == [7, 8, 9]


def test_chat_streamed() -> None:
    def ask(c: openai.OpenAI) -> list[dict]:
        messages = [{"role": "user", "content": "hi"}]
        stream = c.chat.completions.create(model="m", messages=messages, stream=True, **ON)
        return [chunk.model_dump() for chunk in stream]

    first, last = with_client(ask)
    assert first["prompt_token_ids"] == CHAT_IDS and last.get("prompt_token_ids") is None
    assert first["choices"][0]["token_ids"] == [7] and last["choices"][0]["token_ids"] == [8, 9]


def test_off_by_default() -> None:
    def ask(c: openai.OpenAI) -> tuple[dict, list[dict]]:
        whole = c.completions.create(model="m", prompt="ab").model_dump()
        stream = c.completions.create(model="m", prompt="ab", stream=True)
        return whole, [chunk.model_dump() for chunk in stream]

    whole, chunks = with_client(ask)
    for choice in [*whole["choices"], *(ch["choices"][0] for ch in chunks)]:
        assert choice.get("token_ids") is None and choice.get("prompt_token_ids") is None
