"""OpenAI bodies -> GenerateRequests -> the shared validator, and errors -> HTTP statuses
(pure code; the cluster tests are tests/cluster/test_openai_http.py)."""

from __future__ import annotations

import pytest

from router.http_api import error_status
from router.http_api.protocol import parse_request, surrogate_path, to_specs
from router.placement.config import RequestLimits
from router.placement.types import NoWorkersError
from router.serving.core import ClusterOverloaded, StreamBroken
from worker.engine import EngineOverloaded, InvalidRequest

LIMITS = RequestLimits()


def specs(body: dict, chat: bool = False, tenant: str | None = None):  # noqa: ANN201
    meta, reqs = parse_request(body, chat=chat, tenant=tenant, limits=LIMITS, now=0)
    return meta, to_specs(reqs, tenant=tenant, lora=None, limits=LIMITS)


def test_completion_fields_reach_the_sampling_params() -> None:
    meta, (s,) = specs(
        {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": -1,
            "min_p": 0.1,
            "n": 2,
            "seed": 3,
            "stop": "END",
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logprobs": 2,
            "user": "u1",
            "cache_salt": "s",
        }
    )
    p = s.params
    assert (p.max_tokens, p.temperature, p.top_k, p.n, p.seed, p.stop, p.logprobs) == (
        7,
        0.5,
        None,
        2,
        3,
        ("END",),
        2,
    )
    assert p.top_p == pytest.approx(0.9) and p.min_p == pytest.approx(0.1)
    assert p.presence_penalty == 0.5 and p.frequency_penalty == -0.5
    assert p.cache_salt is not None and s.text == "hi"
    assert meta.top_logprobs == 2 and not meta.stream and meta.response_id.startswith("cmpl-")


def test_chat_fields_and_logprobs() -> None:
    meta, (s,) = specs(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 5,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        chat=True,
    )
    assert s.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    )
    assert s.params.max_tokens == 5 and s.params.logprobs == 1  # sampled token's logprob
    assert meta.top_logprobs == 0 and meta.include_usage and meta.stream


def test_prompt_forms_and_tenant_salt() -> None:
    _, batch = specs({"model": "m", "prompt": ["a", "b"]})
    assert [s.text for s in batch] == ["a", "b"]
    assert len({s.request_id for s in batch}) == 2
    _, (ids,) = specs({"model": "m", "prompt": [5, 6, 7]})
    assert ids.token_ids == [5, 6, 7]
    _, (mine,) = specs({"model": "m", "prompt": "x"}, tenant="alice")
    assert mine.params.cache_salt == "tenant:alice"


@pytest.mark.parametrize(
    "body,field",
    [
        ([], "body"),
        ({"model": "m", "prompt": "x", "bogus": 1}, "bogus"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": 2**40}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "priority": 2**40}, "priority"),
        ({"model": "m", "prompt": "x", "stop_token_ids": "1"}, "stop_token_ids"),
        ({"model": "m", "prompt": "x", "request_id": "a\r\nX: y"}, "request_id"),
        ({"model": "m", "prompt": "x", "request_id": "\u20ac"}, "request_id"),
        (
            {
                "model": "m",
                "prompt": "x",
                "stream": True,
                "stream_options": {"continuous_usage_stats": True},
            },
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_bad_bodies_name_the_field(body: object, field: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        specs(body)  # type: ignore[arg-type]
    assert exc.value.field == field


def test_errors_map_to_statuses() -> None:
    assert error_status(InvalidRequest("top_p", 2, "must be in (0, 1]")).status == 400
    assert error_status(EngineOverloaded(2, 2)).status == 429
    assert error_status(ClusterOverloaded("full")).status == 429
    assert error_status(NoWorkersError("none")).status == 503
    assert error_status(StreamBroken("died")).status == 503
    assert error_status(RuntimeError("bug")).status == 500


def test_chat_extras_are_type_checked_and_surrogates_are_found() -> None:
    msgs = [{"role": "user", "content": "x"}]
    for extra, field in (
        ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name"),
        ({"messages": msgs, "max_completion_tokens": 2, "max_tokens": "x"}, "max_tokens"),
    ):
        with pytest.raises(InvalidRequest) as exc:
            specs({"model": "m", "messages": msgs, **extra}, chat=True)
        assert exc.value.field == field
    body = {"model": "m", "stop": ["ok", "\ud800"], "messages": [{"content": "\U0001f600"}]}
    assert surrogate_path(body) == "body.stop[1]"
    assert surrogate_path({"\udfff": 1}) == "body.\\udfff"  # escaped: printable
    assert surrogate_path({"messages": [{"content": "\U0001f600"}], "n": [1, 2]}) is None
