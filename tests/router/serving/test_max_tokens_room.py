"""``max_tokens`` against what the prompt leaves of the context, as vLLM and SGLang read it: a
given one that does not fit is refused before routing (naming the field as the client spelled
it, the limit, the context length and the prompt's tokens); an unset one is fitted (the
default 16 cut to the room, OpenAI's chat given all of it). Both edges' parsers, the shared
intake and a real serving core over in-process workers."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from kvstore.requests.errors import InvalidRequest
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.edge.convert import spec_from_pb
from router.http_api.openai_request import parse_request
from router.http_api.responses_request import parse_responses
from router.placement.config import RequestLimits, RoutingConfig
from router.placement.router import Router
from router.serving.core import ModelLimits, ServingCore
from router.serving.edge_intake import Intake
from router.serving.generate_spec import GenerateSpec
from tests.router.serving.test_serving import HeldWorkers

MAX_MODEL_LEN = 64
LIMITS = ModelLimits("m", vocab_size=1000, max_model_len=MAX_MODEL_LEN, max_prompt_tokens=63)


class CharTokenizer:
    """One token per character; a chat is one token per character of its contents."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * len(text)

    def encode_chat(self, messages: list, **options: object) -> list[int]:
        return [1] * sum(len(m["content"]) for m in messages)


def http(body: dict[str, Any], chat: bool) -> GenerateSpec:
    _, (spec,) = parse_request(
        {"model": "m", **body}, chat=chat, tenant=None, limits=RequestLimits(), now=0
    )
    return spec


def completion(prompt_tokens: int, **body: Any) -> GenerateSpec:
    return http({"prompt": "p" * prompt_tokens, **body}, chat=False)


def chat(prompt_tokens: int, **body: Any) -> GenerateSpec:
    return http({"messages": [{"role": "user", "content": "c" * prompt_tokens}], **body}, True)


def responses(prompt_tokens: int, **body: Any) -> GenerateSpec:
    _, spec = parse_responses(
        {"model": "m", "input": "r" * prompt_tokens, **body},
        tenant=None,
        limits=RequestLimits(),
        now=0,
    )
    return spec


def grpc(prompt_tokens: int, **params: Any) -> GenerateSpec:
    return spec_from_pb(
        pb.GenerateRequest(text="g" * prompt_tokens, params=pb.SamplingParams(**params))
    )


def serve(specs: list[GenerateSpec]) -> tuple[list[int | InvalidRequest], HeldWorkers]:
    """Each spec through the intake and a real serving core: the ``max_tokens`` its worker
    was sent, or the error that refused it."""
    directory = HeldWorkers()
    directory.release.set()
    core = ServingCore(
        Router(RoutingConfig(policy="round_robin"), block_size=16), directory, LIMITS
    )
    intake = Intake(core, CharTokenizer(), auth=None, limits=RequestLimits())  # type: ignore[arg-type]

    async def one(spec: GenerateSpec) -> int | InvalidRequest:
        sent = len(directory.requests)
        try:
            ids = await intake.token_ids(spec)
            async for _ in intake.generate(spec, ids):
                pass
        except InvalidRequest as exc:
            assert len(directory.requests) == sent  # refused before any worker saw it
            return exc
        return directory.requests[-1].params.max_tokens

    async def main() -> list[int | InvalidRequest]:
        return [await one(s) for s in specs]

    try:
        return asyncio.run(main()), directory
    finally:
        core.close()
        intake.close()


def test_a_given_max_tokens_over_the_room_is_refused_naming_the_field_as_sent() -> None:
    results, directory = serve(
        [
            completion(60, max_tokens=5),
            chat(60, max_completion_tokens=5),
            chat(60, max_tokens=5),
            grpc(60, max_tokens=5),
            responses(60, max_output_tokens=5),
            completion(60, max_tokens=4),  # the context exactly full
            grpc(10, max_tokens=54),
        ]
    )
    fields = ["max_tokens", "max_completion_tokens", "max_tokens", "max_tokens"]
    fields.append("max_output_tokens")
    for err, field in zip(results[:5], fields, strict=True):
        assert isinstance(err, InvalidRequest), err
        assert (err.field, err.value) == (field, 5)
        assert "must be at most 4: max_model_len=64 minus the prompt's 60 tokens" in str(err)
    assert results[5:] == [4, 54]
    assert len(directory.requests) == 2


def test_an_unset_max_tokens_is_fitted_to_the_room() -> None:
    results, _ = serve(
        [
            completion(60),  # the default 16 cut to the 4 the prompt leaves
            completion(10),  # the default as is
            grpc(60),
            grpc(10),
            chat(60),  # OpenAI's chat: as long as the context allows
            chat(10),
            responses(10),  # as the chat
        ]
    )
    assert results == [4, 16, 4, 16, 4, 54, 54]


def test_the_prompt_is_named_when_it_leaves_no_room_and_min_tokens_when_it_cannot_fit() -> None:
    results, _ = serve(
        [
            completion(64, max_tokens=1),
            completion(64),
            chat(60, min_tokens=8),  # the room (4) is below min_tokens: named, not clamped
            completion(60, min_tokens=8),
        ]
    )
    assert [(e.field, e.value) for e in results] == [  # type: ignore[union-attr]
        ("prompt", 64),
        ("prompt", 64),
        ("min_tokens", 8),
        ("min_tokens", 8),
    ]


@pytest.mark.parametrize("given", [True, False])
def test_a_resumed_stream_is_checked_against_its_original_prompt(given: bool) -> None:
    """A client resuming after its router died sends the prompt and the tokens it has: the
    room is the original prompt's (the continuation's own is smaller by what was sent)."""
    spec = grpc(40, max_tokens=24) if given else grpc(40)
    resumed = replace(spec, continue_from=(7, 7, 7))
    results, directory = serve([resumed])
    assert results == [24 - 3 if given else 16 - 3]
    assert len(directory.requests[-1].token_ids) == 43
