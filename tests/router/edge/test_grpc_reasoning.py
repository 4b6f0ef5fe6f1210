"""``GenerateRequest.split_reasoning`` over a real grpc.aio server on a scripted serving core:
a reasoning model's reasoning comes in ``reasoning``, the answer alone in ``text``, streamed
and unary, per sample; a resumed stream (``continue_from``) splits where the first router
left off; unasked, or on a model without markers, the text is as the model wrote it."""

from __future__ import annotations

from typing import Any

from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from tests.router.edges import both_calls, grpc_servicer
from tests.router.http_api.test_http_hostile_bodies import Core as OneTokenCore
from tests.router.http_api.test_http_hostile_bodies import Tokenizer as OneTokenTokenizer
from worker.model.reasoning_markers import ReasoningMarkers

MARKERS = ReasoningMarkers(90, 91)
PIECES = ("<think>", "\nWarm", " and dry.", "\n</think>", "\n\nSunny.")
IDS = {"<think>": 90, "\n</think>": 91}


class Core(OneTokenCore):
    """Two samples, each answering ``PIECES`` one output at a time (from ``continue_from``
    on, as a worker continues a resumed stream)."""

    async def generate(self, request_id, token_ids, params, *, tenant=None, continue_from=()):  # noqa: ANN001, ANN201, E501
        start = len(continue_from)
        for i, text in enumerate(PIECES[start:], start=start):
            last = i == len(PIECES) - 1
            outs = [
                CompletionDelta(
                    k,
                    text,
                    [IDS.get(text, 10 + i)],
                    finish_reason=FinishReason.STOP if last else None,
                )
                for k in range(params.n)
            ]
            yield "w0", RequestOutput(request_id, outs, last, Usage(len(token_ids), 0, i + 1))


class Tokenizer(OneTokenTokenizer):
    def decode(self, ids, skip_special_tokens: bool = True) -> str:  # noqa: ANN001
        return "".join(
            next(p for p in PIECES if IDS.get(p, 10 + PIECES.index(p)) == t) for t in ids
        )


def served(req: pb.GenerateRequest, reasoning: ReasoningMarkers | None = MARKERS) -> Any:
    svc = grpc_servicer(Core(), Tokenizer(), reasoning=reasoning)

    return both_calls(svc, req)


def joined(msgs: list[pb.GenerateResponse], index: int) -> tuple[str, str]:
    mine = [m for m in msgs if m.index == index]
    return "".join(m.reasoning for m in mine), "".join(m.text for m in mine)


def test_the_reasoning_comes_apart_streamed_and_unary_per_sample() -> None:
    req = pb.GenerateRequest(
        text="Weather?", params=pb.SamplingParams(max_tokens=8, n=2), split_reasoning=True
    )
    streamed, unary = served(req)
    for index in (0, 1):
        assert joined(streamed, index) == ("Warm and dry.", "Sunny.")
    assert [(c.reasoning, c.text) for c in unary.completions] == [("Warm and dry.", "Sunny.")] * 2
    assert all("think>" not in m.text + m.reasoning for m in streamed)
    # the token ids are the model's, markers included
    assert [t for m in streamed if m.index == 0 for t in m.token_ids][:1] == [90]


def test_a_resumed_stream_splits_where_the_first_router_left_off() -> None:
    req = pb.GenerateRequest(
        text="Weather?",
        params=pb.SamplingParams(max_tokens=8),
        split_reasoning=True,
        continue_from=[90, 11],  # "<think>", "\nWarm": the client has them
    )
    streamed, _ = served(req)
    assert joined(streamed, 0) == (" and dry.", "Sunny.")


def test_unasked_or_without_markers_the_text_is_as_written() -> None:
    whole = "".join(PIECES)
    plain = pb.GenerateRequest(text="Weather?", params=pb.SamplingParams(max_tokens=8))
    streamed, unary = served(plain)
    assert joined(streamed, 0) == ("", whole) and unary.completions[0].text == whole
    asked = pb.GenerateRequest(
        text="Weather?", params=pb.SamplingParams(max_tokens=8), split_reasoning=True
    )
    streamed, unary = served(asked, reasoning=None)
    assert joined(streamed, 0) == ("", whole) and unary.completions[0].reasoning == ""
