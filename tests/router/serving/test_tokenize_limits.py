"""Head-of-line blocking in the router's tokenization (no Ray, no gRPC server: the servicer
is called directly, with a tokenizer that records where it runs and can be held).

Over-limit texts are rejected before the tokenizer sees them, for Tokenize as for Generate;
tokenizing runs on the router's own threads, and a flood of huge inputs held in the tokenizer
does not keep a short one from being served.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.edge.servicer import KVClusterServicer
from router.placement.config import RequestLimits
from router.serving.core import ModelLimits
from router.serving.tokenizing import SMALL_TEXT_CHARS, prompt_chars_limit
from tests.router.edges import grpc_servicer, http_server

MAX_MODEL_LEN = 512
LIMITS = RequestLimits(max_chars_per_token=16)  # 8192 characters for max_model_len 512


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def invocation_metadata(self) -> tuple:
        return ()


class SpyTokenizer:
    """One id per character; texts longer than ``hold_over`` block until ``release``."""

    def __init__(self, hold_over: int | None = None) -> None:
        self.calls: list[tuple[int, str]] = []  # (length, thread name)
        self.hold_over = hold_over
        self.release = threading.Event()
        self.holding = threading.Semaphore(0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((len(text), threading.current_thread().name))
        if self.hold_over is not None and len(text) > self.hold_over:
            self.holding.release()
            self.release.wait(30)
        return [1] * min(len(text), 4)


class Core:
    """What the servicer reads of the serving core for Tokenize and a text Generate."""

    limits = ModelLimits(
        "m", vocab_size=100, max_model_len=MAX_MODEL_LEN, max_prompt_tokens=MAX_MODEL_LEN - 1
    )

    async def generate(self, request_id, token_ids, params, *, tenant=None, continue_from=()):  # noqa: ANN001, ANN201, E501
        yield "w0", None

    def check_room(self) -> None:  # queues never full
        pass


def servicer(tok: SpyTokenizer) -> KVClusterServicer:
    return grpc_servicer(Core(), tok, limits=LIMITS)


def test_over_limit_text_is_rejected_before_tokenizing() -> None:
    tok = SpyTokenizer()
    svc = servicer(tok)
    cap = prompt_chars_limit(LIMITS, MAX_MODEL_LEN)
    assert cap == 8192

    async def main() -> list[Aborted]:
        errors = []
        try:
            await svc.Tokenize(pb.TokenizeRequest(text="x" * (cap + 1)), Context())
        except Aborted as exc:
            errors.append(exc)
        try:
            await svc._start(pb.GenerateRequest(text="y" * (cap + 1)), Context())
        except Exception as exc:  # noqa: BLE001 - InvalidRequest, before the servicer maps it
            errors.append(exc)
        ok = await svc.Tokenize(pb.TokenizeRequest(text="z" * cap), Context())
        assert list(ok.token_ids) == [1] * 4
        return errors

    errors = asyncio.run(main())
    assert len(errors) == 2
    assert errors[0].code == grpc.StatusCode.INVALID_ARGUMENT
    for e in (errors[0].details, str(errors[1])):
        assert "text" in e and "at most 8192 characters" in e and "max_model_len=512" in e
        assert "max_chars_per_token=16" in e
    assert [n for n, _ in tok.calls] == [cap]  # only the text within the limit was tokenized
    assert all(name.startswith("tokenize-") for _, name in tok.calls)


@pytest.mark.parametrize("huge", [8])
def test_huge_tokenize_calls_do_not_hold_up_a_short_one(huge: int) -> None:
    big = SMALL_TEXT_CHARS + 1
    tok = SpyTokenizer(hold_over=SMALL_TEXT_CHARS)
    svc = grpc_servicer(Core(), tok, limits=RequestLimits(max_chars_per_token=1 << 10))

    async def main() -> list[int]:
        floods = [
            asyncio.create_task(svc.Tokenize(pb.TokenizeRequest(text="h" * big), Context()))
            for _ in range(huge)
        ]
        # the flood is inside the tokenizer, holding every thread it was given
        await asyncio.to_thread(tok.holding.acquire, True, 10)
        await asyncio.sleep(0.1)
        # the loop's default executor (index lookups) is not among them
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 1), 5) == 1
        try:
            short = await asyncio.wait_for(
                svc.Tokenize(pb.TokenizeRequest(text="hello"), Context()), 5
            )
        finally:
            tok.release.set()
            await asyncio.gather(*floods)
        return list(short.token_ids)

    assert asyncio.run(main()) == [1, 1, 1, 1]
    assert {name.rsplit("_", 1)[0] for n, name in tok.calls if n == 5} == {"tokenize-short"}


def test_http_edge_rejects_over_limit_text_before_tokenizing() -> None:
    from router.serving.generate_spec import GenerateSpec
    from worker.engine import InvalidRequest, SamplingParams

    tok = SpyTokenizer()
    server = http_server(Core(), tok, limits=LIMITS)

    def spec(text: str) -> GenerateSpec:
        return GenerateSpec("r", text, None, SamplingParams(max_tokens=1), "", True)

    async def main() -> list[int]:
        with pytest.raises(InvalidRequest, match="at most 8192 characters"):
            await server.intake.token_ids(spec("x" * 8193))
        return await server.intake.token_ids(spec("ok"))

    assert asyncio.run(main()) == [1, 1]
    assert [(n, name.startswith("tokenize-short")) for n, name in tok.calls] == [(2, True)]


class ChatSpyTokenizer(SpyTokenizer):
    def encode_chat(self, messages, add_generation_prompt: bool = True, **_: object) -> list[int]:  # noqa: ANN001
        return self.encode("".join(m["content"] for m in messages))


def test_over_limit_conversation_is_rejected_before_rendering_on_both_edges() -> None:
    """Chat messages get the text prompts' character cap (before the template is rendered
    and tokenized), over gRPC and HTTP: a megabyte of chat costs the router nothing."""
    from router.serving.generate_spec import GenerateSpec
    from worker.engine import SamplingParams

    tok = ChatSpyTokenizer()
    svc = grpc_servicer(Core(), tok, limits=LIMITS)
    server = http_server(Core(), tok, limits=LIMITS)
    half = "w" * 4097  # two of these: 8194 characters of content, over 8192

    def chat(*contents: str) -> pb.GenerateRequest:
        msgs = [pb.ChatMessage(role="user", content=c) for c in contents]
        return pb.GenerateRequest(messages=pb.ChatMessages(messages=msgs))

    def chat_spec(*contents: str) -> GenerateSpec:
        msgs = tuple({"role": "user", "content": c} for c in contents)
        return GenerateSpec("r", None, None, SamplingParams(max_tokens=1), "", True, messages=msgs)

    async def main() -> list[str]:
        errors = []
        try:
            await svc._start(chat(half, half), Context())
        except Exception as exc:  # noqa: BLE001 - InvalidRequest, before the servicer maps it
            errors.append(str(exc))
        try:
            await server.intake.token_ids(chat_spec(half, half))
        except Exception as exc:  # noqa: BLE001
            errors.append(str(exc))
        assert await server.intake.token_ids(chat_spec("fits")) == [1] * 4
        return errors

    errors = asyncio.run(main())
    assert len(errors) == 2
    for e in errors:
        assert "messages" in e and "<8194 chars>" in e and "at most 8192 characters" in e
    assert [n for n, _ in tok.calls] == [4]  # only the conversation within the limit


def test_tools_and_calls_count_against_the_cap_before_rendering_on_both_edges() -> None:
    """The template writes a chat's tools and past tool calls into its prompt: megabytes of
    them beside a short message are refused before anything is rendered (they took the
    router seconds to render and tokenize, in the pool short texts use, only to be refused
    as too long)."""
    import json

    from router.http_api.openai_request import parse_request

    tok = ChatSpyTokenizer()
    svc = grpc_servicer(Core(), tok, limits=LIMITS)
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 9000}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "a" * 9000}}
    hi = {"role": "user", "content": "hi"}
    grpc_reqs = [
        pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(**hi)], tools=json.dumps([tool]))
        ),
        pb.GenerateRequest(
            messages=pb.ChatMessages(
                messages=[pb.ChatMessage(role="assistant", tool_calls=json.dumps([call])), hi]
            )
        ),
    ]
    bodies = [
        {"messages": [hi], "tools": [tool]},
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}, hi]},
    ]
    http_specs = [
        parse_request({"model": "m", **b}, chat=True, tenant=None, limits=LIMITS, now=0)[1][0]
        for b in bodies
    ]

    async def main() -> list[str]:
        errors = []
        for req in grpc_reqs:
            try:
                await svc._start(req, Context())
            except Exception as exc:  # noqa: BLE001 - InvalidRequest, before it is mapped
                errors.append(str(exc))
        for spec in http_specs:
            try:
                await svc.intake.token_ids(spec)
            except Exception as exc:  # noqa: BLE001
                errors.append(str(exc))
        return errors

    errors = asyncio.run(main())
    assert len(errors) == 4, errors
    for e in errors:
        assert "invalid messages=" in e and "characters of content and tools" in e, e
    assert tok.calls == []  # nothing rendered or tokenized
