"""OpenAI bodies -> the intake's requests (the shared validator), and errors -> HTTP
statuses (pure code; the cluster tests are tests/cluster/test_openai_http.py)."""

from __future__ import annotations

import pytest

from kvstore.requests.errors import WireMismatch
from router.http_api import error_status
from router.http_api.body import BodyLimits, parse_json, surrogate_path
from router.http_api.openai_request import parse_request
from router.placement.config import RequestLimits
from router.placement.placement_types import NoWorkersError
from router.serving.core import ClusterOverloaded, StreamBroken
from router.serving.request_errors import BadBody, BodyTooLarge
from worker.engine import EngineOverloaded, InvalidRequest

LIMITS = RequestLimits()


def specs(body: dict, chat: bool = False, tenant: str | None = None, **kw):  # noqa: ANN201
    return parse_request(body, chat=chat, tenant=tenant, limits=LIMITS, now=0, **kw)


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
    assert s.params.max_tokens == 5 and s.params.logprobs == 0  # sampled token's logprob
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
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": float("nan")}, "temperature"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": "m", "prompt": "x", "logit_bias": {"a": 2}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 200}}, "logit_bias[1]"),
        ({"model": "m", "prompt": "x", "priority": 2**40}, "priority"),
        ({"model": "m", "prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        ({"model": "m", "prompt": "x", "allowed_token_ids": "1"}, "allowed_token_ids"),
        ({"model": "m", "prompt": "x", "allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"model": "m", "prompt": "x", "allowed_token_ids": [1.5]}, "allowed_token_ids"),
        ({"model": "m", "prompt": "x", "bad_words": "no"}, "bad_words"),
        ({"model": "m", "prompt": "x", "bad_words": ["no", 3]}, "bad_words"),
        ({"model": "m", "prompt": "x", "bad_words": [" "]}, "bad_words"),
        ({"model": "m", "prompt": "x", "stop_token_ids": "1"}, "stop_token_ids"),
        ({"model": "m", "prompt": "x", "request_id": "a\r\nX: y"}, "request_id"),
        ({"model": "m", "prompt": "x", "request_id": "\u20ac"}, "request_id"),
        # errors name the field as OpenAI's API spells it (not the gRPC API's text/token_ids)
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": [[]]}, "prompt"),
        # both token limits are checked, whichever wins
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3}
            | {"max_tokens": -5},
            "max_tokens",
        ),
        ({"model": "m", "prompt": "x", "request_id": "r" * 20000}, "request_id"),
        ({"model": "m", "prompt": "x", "seed": 2**64}, "seed"),
        ({"model": "m", "prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"model": "m", "prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        (
            {"model": "m", "prompt": "x", "response_format": {"type": "xml"}},
            "response_format.type",
        ),
    ],
)
def test_bad_bodies_name_the_field(body: object, field: str) -> None:
    chat = isinstance(body, dict) and "messages" in body
    with pytest.raises(InvalidRequest) as exc:
        specs(body, chat=chat)  # type: ignore[arg-type]
    assert exc.value.field == field
    assert error_status(exc.value).param == field


def test_errors_map_to_statuses() -> None:
    assert error_status(InvalidRequest("top_p", 2, "must be in (0, 1]")).http_status == 400
    assert error_status(EngineOverloaded(2, 2)).http_status == 429
    assert error_status(ClusterOverloaded("full")).http_status == 429
    assert error_status(NoWorkersError("none")).http_status == 503
    assert error_status(StreamBroken("died")).http_status == 503
    assert error_status(RuntimeError("bug")).http_status == 500
    mismatch = error_status(WireMismatch("SamplingParams: unknown field 'x'"))
    assert (mismatch.http_status, mismatch.code) == (503, "version_mismatch")
    assert "unknown field 'x'" in mismatch.message and "upgrade" in mismatch.message
    # a hint to retry where retrying may succeed, none where it cannot
    retry = [EngineOverloaded(2, 2), ClusterOverloaded("f"), NoWorkersError("n"), StreamBroken("d")]
    assert all(error_status(e).retry_after_s == 1 for e in retry)
    assert error_status(InvalidRequest("n", 0, "x")).retry_after_s is None
    assert mismatch.retry_after_s is None and error_status(RuntimeError()).retry_after_s is None


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
    assert surrogate_path(body) == "stop[1]"
    assert surrogate_path({"\udfff": 1}) == "\\udfff"  # escaped: printable
    assert surrogate_path({"messages": [{"content": "\U0001f600"}], "n": [1, 2]}) is None


LIM = BodyLimits(1 << 22, max_items=1000, max_depth=8)


@pytest.mark.parametrize(
    "data,error,needle",
    [
        # raw surrogate bytes are not UTF-8: a 400, not a 500 (in a value or a key)
        (b'{"prompt": "\xed\xa0\x80"}', BadBody, "not UTF-8"),
        (b'{"\xed\xa0\x80": 1}', BadBody, "not UTF-8"),
        (b'{"prompt": "\\ud800"}', InvalidRequest, "prompt"),
        (b'{"a": [' + b",".join([b"[]"] * 2000) + b"]}", BodyTooLarge, "JSON values"),
        (b'{"a": ' + b"[" * 9 + b"]" * 9 + b"}", BodyTooLarge, "nests over 8 levels"),
        (b"[" * 100000 + b"]" * 100000, BodyTooLarge, "JSON values"),
        (b'["' + b'","' * 2000 + b'"]', BodyTooLarge, "JSON values"),  # 2001 strings
    ],
)
def test_bodies_are_bounded_before_parsing(data: bytes, error: type, needle: str) -> None:
    with pytest.raises(error, match=needle):
        parse_json(data, LIM)


def test_structure_counts_ignore_string_contents() -> None:
    """Commas, brackets and escaped quotes inside strings are text, not structure."""
    text = '[[[[[[[[[[, ,\\" \\\\ {{{{{{{{{{ ' * 200
    body = {"prompt": text, "stop": ["]]]]]]]]]]]]"], "n": 1}
    import json

    assert parse_json(json.dumps(body).encode(), LIM) == body
    deep = {"a": [[[[[[["ok"]]]]]]]}  # 8 levels: at the limit
    assert parse_json(json.dumps(deep).encode(), LIM) == deep


def test_new_fields_reach_the_request() -> None:
    meta, (s,) = specs(
        {
            "prompt": "hi",
            "seed": -1,
            "logit_bias": {"5": -100, "7": 2.5},
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "truncate_prompt_tokens": 4,
            "return_tokens_as_token_ids": True,
            "echo": True,
            "store": False,
            "metadata": {"k": "v"},
            "service_tier": "auto",
            "response_format": {"type": "text"},
            "parallel_tool_calls": True,
            "temperature": None,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    )
    p = s.params
    assert p.seed == 2**63 - 1 and p.logit_bias == ((5, -100.0), (7, 2.5))
    assert p.include_stop_str_in_output and not p.skip_special_tokens and p.temperature == 1.0
    assert s.truncate_prompt_tokens == 4 and meta.echo and meta.token_ids_as_text
    assert meta.continuous_usage and meta.model == ""  # no model: the caller's base model
    _, (c,) = specs(
        {
            "messages": [
                {"role": "developer", "content": "d"},
                {"role": "assistant", "content": "a"},
            ],
            "chat_template_kwargs": {"enable_thinking": False},
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        chat=True,
    )
    assert c.chat.continue_final_message and not c.chat.add_generation_prompt
    assert c.chat.template_kwargs == {"enable_thinking": False}
    assert c.messages[0]["role"] == "developer"


def test_request_id_from_the_header() -> None:
    meta, (s,) = specs({"prompt": "x"}, header_request_id="abc-1")
    assert meta.response_id == "cmpl-abc-1" and s.request_id == "cmpl-abc-1"
    meta, _ = specs({"prompt": "x", "request_id": "body"}, header_request_id="abc-1")
    assert meta.response_id == "cmpl-body"  # the body's wins
    with pytest.raises(InvalidRequest) as exc:
        specs({"prompt": "x"}, header_request_id="h" * 500)
    assert exc.value.field == "x-request-id"


@pytest.mark.parametrize("slice_bytes", [1, 2, 3, 7, 64])
def test_structure_scan_is_exact_across_slices(
    slice_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slice boundaries may cut an escape or a run of backslashes anywhere: the count of
    values and the depth come out as for the whole body."""
    import json

    import kvstore.requests.json_text as json_text
    import router.http_api.body as body_mod

    monkeypatch.setattr(body_mod, "SLICE_BYTES", slice_bytes)
    monkeypatch.setattr(json_text, "SLICE_BYTES", slice_bytes)  # the structure scan's
    lim = BodyLimits(1 << 20, max_items=24, max_depth=3)  # fits: 19 by this count
    text = 'a\\\\"[[[[ \\\\\\\\ " ,,,, {{{{ \\\\'
    fits = {"p": text, "q": [[1, 2], {"k": text}], "r": "]]]]"}  # 3 levels, few values
    assert body_mod.parse_json(json.dumps(fits).encode(), lim) == fits
    with pytest.raises(BodyTooLarge, match="nests over 3"):
        body_mod.parse_json(json.dumps({"p": text, "q": [[[text]]]}).encode(), lim)
    with pytest.raises(BodyTooLarge, match="JSON values"):
        body_mod.parse_json(json.dumps({"p": [text] * 13}).encode(), lim)
