"""OpenAI request bodies (parsed JSON) -> the intake's requests, directly.

This parser checks only what JSON adds (an object, JSON types, OpenAI's spellings such as
``stop`` as a string, which fields exist); every range and limit is checked by the shared
validator (:func:`router.serving.request.make_spec`), which names a field as this API
spells it. ``null`` means "not set" for every optional field. Fields this server does not
know are accepted and ignored, as vLLM does (the caller logs and counts them); fields it
knows but cannot honour with the value given are a 400.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvstore.blocks.errors import InvalidRequest
from kvstore.blocks.sampling_params import MAX_SEED
from router.placement.config import RequestLimits
from router.serving.request import ChatOptions, GenerateSpec, check_request_id, make_spec

_INT_PARAMS = ("top_k", "n", "min_tokens")
_FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_BOOL_PARAMS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
# known fields that do not change the output (accepted as sent)
_ACCEPTED = ("user", "store", "metadata", "service_tier", "parallel_tool_calls")
_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "stop",
        "cache_salt",
        "stop_token_ids",
        "priority",
        "request_id",
        "logprobs",
        "best_of",
        "logit_bias",
        "seed",
        "truncate_prompt_tokens",
        "return_tokens_as_token_ids",
        "prompt_logprobs",
        "response_format",
        *_ACCEPTED,
        *_INT_PARAMS,
        *_FLOAT_PARAMS,
        *_BOOL_PARAMS,
    }
)
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "echo",
}
_ROLES = ("system", "developer", "user", "assistant")
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows about 300)


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """How one /v1/completions or /v1/chat/completions answer is shaped."""

    chat: bool  # chat completion (messages) or text completion (prompt)
    model: str  # the name answered with (the client's, or the base model's when omitted)
    stream: bool  # answer with server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage on every chunk
    top_logprobs: int | None  # alternatives per token to return; None: no logprobs
    created: int  # unix time of arrival
    response_id: str  # "cmpl-..." / "chatcmpl-..."
    echo: bool = False  # completions: the prompt before its completion
    token_ids_as_text: bool = False  # return_tokens_as_token_ids: "token_id:<id>" strings
    max_tokens_set: bool = True  # chat without max_tokens: as long as the context allows


def shown(value: Any, limit: int = 64) -> Any:
    """``value`` as an error message may quote it: long strings by their length only."""
    if isinstance(value, str) and len(value) > limit:
        return f"<{len(value)} chars>"
    return value


def _bad_type(name: str, value: Any, kind: str) -> InvalidRequest:
    quoted = value if isinstance(value, int | float | bool | None) else type(value).__name__
    return InvalidRequest(name, quoted, f"must be {kind}")


def _get(body: dict, name: str, ok: Callable[[Any], bool], kind: str) -> Any:
    v = body.get(name)
    if v is not None and not ok(v):
        raise _bad_type(name, v, kind)
    return v


def _int(body: dict, name: str) -> int | None:
    return _get(body, name, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")


def _float(body: dict, name: str) -> float | None:
    v = _get(
        body, name, lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"
    )
    if v is not None and not math.isfinite(v):
        raise InvalidRequest(name, v, "must be a finite number")
    return None if v is None else float(v)


def _str(body: dict, name: str) -> str | None:
    return _get(body, name, lambda v: isinstance(v, str), "a string")


def _bool(body: dict, name: str) -> bool | None:
    return _get(body, name, lambda v: isinstance(v, bool), "true or false")


def _token_ids(name: str, value: list) -> list[int]:
    if not all(type(t) is int for t in value):
        raise InvalidRequest(name, "<list>", "must be a list of integer token ids")
    if value and min(value) < 0:
        raise InvalidRequest(name, min(value), "must be a token id >= 0")
    return value


def _prompts(body: dict) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, a list of strings, a list of token ids, or a list of
    token-id lists."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [_token_ids("prompt", p)]
        if all(isinstance(x, list) for x in p):
            return [_token_ids("prompt", x) for x in p]
    if p is None:
        raise InvalidRequest("prompt", None, "is required")
    raise InvalidRequest(
        "prompt",
        "<" + type(p).__name__ + ">",
        "must be a string, a list of strings, a list of token ids or a "
        "list of token-id lists, and not empty",
    )


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest(
            "messages",
            "<" + type(msgs).__name__ + ">",
            "must be a non-empty list of {role, content} objects",
        )
    out = []
    for i, m in enumerate(msgs):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad_type(name, m, "an object with role and content")
        role = m.get("role")
        if role not in _ROLES:
            raise InvalidRequest(f"{name}.role", shown(role), f"must be one of {', '.join(_ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise InvalidRequest(
                        f"{name}.content[{j}]",
                        "<part>",
                        "must be a {type: 'text', text: str} part (text only)",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad_type(f"{name}.content", content, "a string or a list of text parts")
        if not isinstance(m.get("name") or "", str):
            raise _bad_type(f"{name}.name", m["name"], "a string")
        extra = sorted(k for k, v in m.items() if v is not None)
        extra = [k for k in extra if k not in ("role", "content", "name")]
        if extra:
            raise InvalidRequest(
                name, shown(extra[0]), "unknown message field (supported: role, content, name)"
            )
        out.append({"role": role, "content": content})
    return out


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise _bad_type("stop", stop, "a string or a list of strings")


def _unserved(body: dict, chat: bool) -> None:
    """Fields that would change the output in a way this server does not serve: a 400,
    never silently ignored, unless they hold the value that means "off"."""
    if body.get("suffix") is not None:
        raise InvalidRequest("suffix", "<str>", "is not supported (must be null)")
    if body.get("prompt_logprobs") not in (None, 0, False):
        raise InvalidRequest(
            "prompt_logprobs", shown(body["prompt_logprobs"]), "is not supported (must be null)"
        )
    best_of, n = body.get("best_of"), body.get("n") or 1
    if best_of is not None and best_of != n:
        raise InvalidRequest("best_of", best_of, f"must be null or equal n={n}")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise InvalidRequest(
            "response_format", "<object>", "is not supported (only {'type': 'text'})"
        )
    for name in ("tools", "functions", "function_call"):
        if body.get(name) is not None:
            raise InvalidRequest(name, "<set>", "is not supported (tool calls are not served)")
    if body.get("tool_choice") not in (None, "none"):
        raise InvalidRequest("tool_choice", "<set>", "is not supported (must be null or 'none')")
    if chat and body.get("echo"):
        raise InvalidRequest("echo", True, "is not supported on chat completions")
    if body.get("echo") and body.get("logprobs") is not None:
        raise InvalidRequest(
            "echo", True, "with logprobs needs prompt logprobs, which this server does not return"
        )


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise _bad_type("logit_bias", bias, "an object of token id -> bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            "logit_bias", f"<{len(bias)} entries>", f"must hold at most {MAX_LOGIT_BIAS} entries"
        )
    out = []
    for key, value in bias.items():
        if not key.isdigit() or len(key) > 12:
            raise InvalidRequest("logit_bias", shown(key), "keys must be token ids (digits)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad_type(f"logit_bias[{key}]", value, "a number")
        if not -100 <= value <= 100:
            raise InvalidRequest(f"logit_bias[{key}]", value, "must be in [-100, 100]")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _seed(body: dict) -> int | None:
    """OpenAI allows any 64-bit seed; the engine's RNG takes [0, 2**63): a negative seed
    maps to its two's complement there (deterministic, as a seed must be)."""
    seed = _int(body, "seed")
    if seed is None:
        return None
    if not -(1 << 63) <= seed <= MAX_SEED:
        raise InvalidRequest("seed", seed, f"must be a 64-bit integer in [-2**63, {MAX_SEED}]")
    return seed + (1 << 63) if seed < 0 else seed


def known_fields(chat: bool) -> frozenset[str]:
    return CHAT_FIELDS if chat else COMPLETION_FIELDS


def parse_request(
    body: Any,
    *,
    chat: bool,
    tenant: str | None,
    limits: RequestLimits,
    now: int,
    header_request_id: str | None = None,
) -> tuple[OpenAIRequest, list[GenerateSpec]]:
    """Check an OpenAI body and build the intake request(s) it stands for (one per
    prompt); the caller resolves ``model`` to an adapter. Raises InvalidRequest naming the
    field as OpenAI's API spells it."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", type(body).__name__, "must be a JSON object")
    model = _str(body, "model")
    if model == "":
        raise InvalidRequest("model", "", "must be a model name (see GET /v1/models)")
    _unserved(body, chat)
    names = {"text": "prompt", "token_ids": "prompt"}
    values: dict[str, Any] = {}
    legacy = _int(body, "max_tokens")  # checked even when max_completion_tokens wins
    newer = _int(body, "max_completion_tokens") if chat else None
    for name, v in (("max_tokens", legacy), ("max_completion_tokens", newer)):
        if v is not None and v < 1:
            raise InvalidRequest(name, v, "must be an integer >= 1")
    if newer is not None:
        names["max_tokens"] = "max_completion_tokens"
    if (newer or legacy) is not None:
        values["max_tokens"] = newer or legacy
    for name in _INT_PARAMS:
        if (v := _int(body, name)) is not None:
            values[name] = v
    for name in _FLOAT_PARAMS:
        if (v := _float(body, name)) is not None:
            values[name] = v
    for name in _BOOL_PARAMS:
        if (v := _bool(body, name)) is not None:
            values[name] = v
    if (seed := _seed(body)) is not None:
        values["seed"] = seed
    if bias := _logit_bias(body):
        values["logit_bias"] = bias
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not isinstance(stop_ids, list):
        raise _bad_type("stop_token_ids", stop_ids, "a list of token ids")
    top_logprobs = _logprobs(body, chat, values, names)
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise InvalidRequest(
                "stream_options", "<object>", "must be an object with include_usage"
            )
        if not stream:
            raise InvalidRequest("stream_options", "<object>", "is only allowed with stream=true")
        include_usage = bool(_bool(opts, "include_usage"))
        continuous = bool(_bool(opts, "continuous_usage_stats"))
    for name in ("user", "service_tier"):
        _str(body, name)
    for name in ("store", "parallel_tool_calls"):
        _bool(body, name)
    _get(body, "metadata", lambda v: isinstance(v, dict), "an object")
    truncate = _int(body, "truncate_prompt_tokens")
    if header_request_id is not None:  # echoed in the answer's header too
        check_request_id("x-request-id", header_request_id, limits)
    rid = _str(body, "request_id")
    if rid is not None:
        check_request_id("request_id", rid, limits)
    rid = rid or header_request_id or uuid.uuid4().hex
    response_id = ("chatcmpl-" if chat else "cmpl-") + rid
    common = dict(
        request_id=rid,
        tenant=tenant,
        claimed_tenant=tenant or "",
        cache_salt=_str(body, "cache_salt") or "",
        values=values,
        stop=_stop(body),
        stop_token_ids=_token_ids("stop_token_ids", stop_ids or []),
        priority=_int(body, "priority") or 0,
        truncate_prompt_tokens=truncate,
        limits=limits,
        names=names,
    )
    if chat:
        specs = [
            make_spec(messages=_messages(body), chat=_chat_options(body), **common)  # type: ignore[arg-type]
        ]
        specs[0] = _labelled(specs[0], response_id)
    else:
        prompts = _prompts(body)
        if len(prompts) > limits.max_n:
            raise InvalidRequest(
                "prompt",
                f"<{len(prompts)} prompts>",
                f"must hold at most {limits.max_n} prompts (router.limits.max_n)",
            )
        n = values.get("n", 1)
        if len(prompts) > 1 and len(prompts) * n > limits.max_n:  # one answer holds them all
            raise InvalidRequest(
                "n",
                n,
                f"times {len(prompts)} prompts must be at most {limits.max_n} choices "
                "(router.limits.max_n)",
            )
        specs = []
        for i, p in enumerate(prompts):
            form = {"text": p} if isinstance(p, str) else {"token_ids": p}
            spec = make_spec(**form, **common)  # type: ignore[arg-type]
            specs.append(_labelled(spec, response_id + (f"-{i}" if len(prompts) > 1 else "")))
    meta = OpenAIRequest(
        chat=chat,
        model=model or "",
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        top_logprobs=top_logprobs,
        created=now,
        response_id=response_id,
        echo=bool(_bool(body, "echo")) and not chat,
        token_ids_as_text=bool(_bool(body, "return_tokens_as_token_ids")),
        max_tokens_set="max_tokens" in values,
    )
    return meta, specs


def _labelled(spec: GenerateSpec, label: str) -> GenerateSpec:
    """The answer's id as the request's label (the id itself was checked as sent)."""
    return replace(spec, request_id=label)


def _chat_options(body: dict) -> ChatOptions:
    kwargs = _get(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    add = _bool(body, "add_generation_prompt")
    cont = bool(_bool(body, "continue_final_message"))
    return ChatOptions(
        add_generation_prompt=(not cont) if add is None else add,
        continue_final_message=cont,
        template_kwargs=dict(kwargs or {}),
    )


def _logprobs(body: dict, chat: bool, values: dict, names: dict) -> int | None:
    """Chat: ``logprobs`` (bool) + ``top_logprobs`` (int); completions: ``logprobs`` (int).
    Returns the alternatives to show per token (None: no logprobs)."""
    if chat:
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs")
        if top is not None and not want:
            raise InvalidRequest("top_logprobs", top, "needs logprobs=true")
        if not want:
            return None
        top = top or 0
        names["logprobs"] = "top_logprobs"
    else:
        top = _int(body, "logprobs")
        if top is None:
            return None
    if top < 0:
        raise InvalidRequest(names.get("logprobs", "logprobs"), top, "must be >= 0")
    values["logprobs"] = top
    return top
