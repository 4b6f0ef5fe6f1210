"""Stream events: the pre-encoded per-token path writes exactly the bytes of the chunk
object (pure code; the clients' view is tests/cluster/test_openai_http.py)."""

from __future__ import annotations

import json

import pytest

from kvstore.requests.outputs import CompletionDelta, FinishReason, TokenLogprob, Usage
from router.http_api.openai_request import parse_request
from router.http_api.responses import Shaper
from router.http_api.sse import DONE, sse_event
from router.placement.config import RequestLimits

TEXTS = [
    "",
    " hello",
    'a "quoted" \\ back',
    "line\nbreak\ttab",
    "é ü 中文",
    "\U0001f600",
    "\x00\x1f",
]
REASONS = [None, FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT]
USAGE = Usage(prompt_tokens=12, cached_tokens=4, completion_tokens=3)


def shapers(chat: bool, n: int = 1, **body: object) -> tuple[Shaper, Shaper]:
    """Two shapers of one request (each keeps per-choice state)."""
    base: dict = {"model": "the-model", "stream": True, "n": n}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    base.update(body)
    meta, _ = parse_request(base, chat=chat, tenant=None, limits=RequestLimits(), now=1700)
    return Shaper(meta, n, None), Shaper(meta, n, None)  # type: ignore[arg-type]  # (no decode)


def shaper(chat: bool, n: int = 1, **body: object) -> Shaper:
    return shapers(chat, n, **body)[0]


OPTIONS = [
    {},
    {"stream_options": {"include_usage": True}},
    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    {"logprobs": 2, "return_tokens_as_token_ids": True},
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "usage", "continuous", "logprobs"])
def test_every_event_is_the_chunk_objects_json(chat: bool, options: dict) -> None:
    if chat and "logprobs" in options:
        options = {"logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    for first in (True, False):
        for text in TEXTS:
            for reason in REASONS:
                for index in (0, 2):
                    s, ref = shapers(chat, n=3, **options)
                    lps = [TokenLogprob(7, -0.5, ((7, -0.5), (9, -1.25)))]
                    d = CompletionDelta(index, text, [7], lps, reason)
                    got = s.event(1, d, first, USAGE)
                    want = sse_event(ref.chunk(1, d, first, USAGE))
                    assert got == want, (first, text, reason, index)
                    assert got.startswith(b"data: ") and got.endswith(b"\n\n")
                    obj = json.loads(got[6:])
                    assert obj["choices"][0]["index"] == 3 + index


def test_plain_events_carry_the_text_index_and_reason() -> None:
    s = shaper(False, n=2, stream_options={"include_usage": True})
    d = CompletionDelta(1, "x\ny", [5], None, FinishReason.LENGTH)
    obj = json.loads(s.event(2, d, False)[6:])
    assert obj == {
        "id": s.req.response_id,
        "object": "text_completion",
        "created": 1700,
        "model": "the-model",
        "choices": [{"index": 5, "text": "x\ny", "logprobs": None, "finish_reason": "length"}],
        "usage": None,
    }
    chat = shaper(True)
    obj = json.loads(chat.event(0, CompletionDelta(0, "hé", [5]), False)[6:])
    assert obj["object"] == "chat.completion.chunk" and "usage" not in obj
    assert obj["choices"] == [
        {"index": 0, "delta": {"content": "hé"}, "logprobs": None, "finish_reason": None}
    ]
    assert DONE == b"data: [DONE]\n\n"


def test_echoed_completion_logprobs_put_the_prompt_first_and_offsets_run_on() -> None:
    """With echo, the first event's logprobs start with the prompt's tokens (the first has
    none: null) at offset 0; the completion's start after the echoed text and run on across
    events."""
    body = {"stream": False, "echo": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    meta, _ = parse_request(
        {"model": "m", "prompt": "hi", **body},
        chat=False,
        tenant=None,
        limits=RequestLimits(),
        now=1,
    )
    s = Shaper(meta, 1, None, echoes=["hi"], prompt_ids=[[5, 6]])  # type: ignore[arg-type]
    prompt = [None, TokenLogprob(6, -0.5, ((7, -0.25),))]
    first = s.logprobs_json([TokenLogprob(8, -1.0, ((8, -1.0),))], 0, prompt)
    assert first == {
        "tokens": ["token_id:5", "token_id:6", "token_id:8"],
        "token_logprobs": [None, -0.5, -1.0],
        "top_logprobs": [None, {"token_id:7": -0.25, "token_id:6": -0.5}, {"token_id:8": -1.0}],
        "text_offset": [0, 10, 2],  # the completion's after the echoed "hi"
    }
    second = s.logprobs_json([TokenLogprob(9, -2.0)], 0)
    assert second == {
        "tokens": ["token_id:9"],
        "token_logprobs": [-2.0],
        "top_logprobs": [{"token_id:9": -2.0}],
        "text_offset": [12],  # after "hi" and "token_id:8"
    }
