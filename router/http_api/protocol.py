"""OpenAI request bodies (JSON) -> the gRPC API's GenerateRequest, then the one validator.

The HTTP edge checks only what JSON adds over protobuf: the shape of the body (an object,
known fields, JSON types, OpenAI's spellings such as ``stop`` as a string). Every range and
limit is then checked by :func:`router.convert.spec_from_pb`, the validator the gRPC edge
uses, so both edges accept and reject the same requests with the same messages. Protobuf is
the API's versioned request schema here, not a transport: nothing leaves this module as one.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvstore.blocks.errors import InvalidRequest
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.edge.convert import GenerateSpec, spec_from_pb
from router.http_api import structured, tools
from router.placement.config import RequestLimits

# Sampling fields copied to pb.SamplingParams as they are: name -> JSON type.
_INT_PARAMS = ("top_k", "seed", "n", "min_tokens")
_FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_COMMON = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "stop",
        "user",
        "cache_salt",
        "ignore_eos",
        "stop_token_ids",
        "priority",
        "request_id",
        "logprobs",
        "best_of",
        "logit_bias",
        *_INT_PARAMS,
        *_FLOAT_PARAMS,
    }
)
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix"} | structured.FIELDS
CHAT_FIELDS = (
    _COMMON
    | {"messages", "max_completion_tokens", "top_logprobs"}
    | structured.FIELDS
    | tools.FIELDS
)
_ROLES = ("system", "user", "assistant", "developer", "tool")
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff in a JSON text


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One validated /v1/completions or /v1/chat/completions body."""

    chat: bool  # chat completion (messages) or text completion (prompt)
    model: str  # the name the client asked for (base model or an adapter)
    stream: bool  # answer with server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    top_logprobs: int | None  # alternatives per token to return; None: no logprobs
    created: int  # unix time of arrival
    response_id: str  # "cmpl-..." / "chatcmpl-..."
    tools: tools.ToolSpec | None = None  # chat: the request's tools and tool_choice


def shown(value: Any, limit: int = 64) -> Any:
    """``value`` as an error message may quote it: long strings by their length only."""
    if isinstance(value, str) and len(value) > limit:
        return f"<{len(value)} chars>"
    return value


def _bad_type(field: str, value: Any, kind: str) -> InvalidRequest:
    shown = value if isinstance(value, int | float | bool | None) else type(value).__name__
    return InvalidRequest(field, shown, f"must be {kind}")


def _int(body: dict, field: str) -> int | None:
    v = body.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad_type(field, v, "an integer")
    return v


def _float(body: dict, field: str) -> float | None:
    v = body.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad_type(field, v, "a number")
    if not math.isfinite(v):
        raise InvalidRequest(field, v, "must be a finite number")
    return float(v)


def _str(body: dict, field: str) -> str | None:
    v = body.get(field)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _bad_type(field, v, "a string")
    return v


def _bool(body: dict, field: str) -> bool | None:
    v = body.get(field)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad_type(field, v, "true or false")
    return v


def _uint(field: str, value: int, limit: int = (1 << 32) - 1) -> int:
    """The protobuf field's range (uint32/uint64): out of range is a 400, not an overflow."""
    if not 0 <= value <= limit:
        raise InvalidRequest(field, value, f"must be an integer in [0, {limit}]")
    return value


def _token_ids(field: str, value: list) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequest(field, "<list>", "must be a list of integer token ids")
    return [_uint(field, t) for t in value]


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


def _messages(body: dict) -> pb.ChatMessages:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest(
            "messages",
            "<" + type(msgs).__name__ + ">",
            "must be a non-empty list of {role, content} objects",
        )
    out = pb.ChatMessages()
    for i, m in enumerate(msgs):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad_type(field, m, "an object with role and content")
        role = m.get("role")
        if role not in _ROLES:
            raise InvalidRequest(
                f"{field}.role", shown(role), f"must be one of {', '.join(_ROLES)}"
            )
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
                        f"{field}.content[{j}]",
                        "<part>",
                        "must be a {type: 'text', text: str} part (text only)",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        msg = pb.ChatMessage(role=role)
        tools.message_to_pb(m, field, msg)  # tool_calls, tool_call_id, name
        if content is None and msg.tool_calls:
            content = ""
        if not isinstance(content, str):
            raise _bad_type(f"{field}.content", content, "a string or a list of text parts")
        extra = set(m) - {"role", "content", *tools.MESSAGE_FIELDS}
        if extra:
            raise InvalidRequest(
                f"{field}",
                shown(sorted(extra)[0]),
                "unknown message field (supported: role, content, name, tool_calls, tool_call_id)",
            )
        msg.content = content
        out.messages.append(msg)
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


def _unsupported(body: dict, chat: bool) -> None:
    """Fields OpenAI defines that this server cannot honour: a 400, never silently ignored,
    unless they hold the value that means "off"."""
    if body.get("echo") not in (None, False):
        raise InvalidRequest("echo", body["echo"], "is not supported (must be false)")
    if body.get("suffix") is not None:
        raise InvalidRequest("suffix", "<str>", "is not supported (must be null)")
    if body.get("logit_bias") not in (None, {}):
        raise InvalidRequest("logit_bias", "<object>", "is not supported (must be null)")
    best_of, n = body.get("best_of"), body.get("n", 1)
    if best_of is not None and best_of != n:
        raise InvalidRequest("best_of", best_of, f"must be null or equal n={n}")


def surrogate_path(body: Any) -> str | None:
    """Where ``body`` holds a string with a lone surrogate (JSON's ``"\\ud800"`` decodes to
    one): such text has no UTF-8 form, so protobuf, the tokenizer and the response would
    fail on it. None when every string is valid text. Only for a body whose bytes hold such
    an escape (:data:`SURROGATE_ESCAPE`): the walk is linear in the body's items."""
    stack: list[tuple[Any, Any]] = [("body", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode()
                except UnicodeEncodeError:  # (a key's path may hold it too: escaped)
                    return path.encode("utf-8", "backslashreplace").decode()
        elif isinstance(v, dict):
            stack.extend((f"{path}.{k}", k) for k in v)
            stack.extend((f"{path}.{k}", x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend(
                (f"{path}[{i}]", x) for i, x in enumerate(v) if isinstance(x, str | list | dict)
            )
    return None


def _request_id(body: dict) -> str | None:
    """The client's id is echoed in the ``x-request-id`` header: printable ASCII only."""
    rid = _str(body, "request_id")
    if rid and not all(" " <= ch <= "~" for ch in rid):
        raise InvalidRequest(
            "request_id", shown(rid.encode("unicode_escape").decode()), "must be printable ASCII"
        )
    return rid


def parse_request(
    body: Any, *, chat: bool, tenant: str | None, limits: RequestLimits, now: int
) -> tuple[OpenAIRequest, list[pb.GenerateRequest]]:
    """Check an OpenAI body and build the GenerateRequest(s) it stands for; the caller
    resolves ``model`` and runs :func:`to_specs`. Raises InvalidRequest naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", type(body).__name__, "must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(
            shown(unknown[0]),
            "<set>",
            f"is not a known field of this endpoint (known: {', '.join(sorted(allowed))})",
        )
    model = _str(body, "model")
    if not model:
        raise InvalidRequest("model", model, "is required (see GET /v1/models)")
    _unsupported(body, chat)
    params = pb.SamplingParams()
    legacy = _int(body, "max_tokens")  # checked even when max_completion_tokens wins
    max_tokens = _int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = legacy
    if max_tokens is not None:
        params.max_tokens = _uint("max_tokens", max_tokens)
    for name in _INT_PARAMS:
        v = _int(body, name)
        if v is not None:
            if name == "top_k" and v == -1:  # vLLM's "disabled"
                v = 0
            setattr(
                params, name, _uint(name, v, (1 << 64) - 1 if name == "seed" else (1 << 32) - 1)
            )
    for name in _FLOAT_PARAMS:
        v = _float(body, name)
        if v is not None:
            setattr(params, name, v)
    ignore_eos = _bool(body, "ignore_eos")
    if ignore_eos is not None:
        params.ignore_eos = ignore_eos
    params.stop.extend(_stop(body))
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise _bad_type("stop_token_ids", stop_ids, "a list of token ids")
        params.stop_token_ids.extend(_token_ids("stop_token_ids", stop_ids))
    top_logprobs = _logprobs(body, chat, params)
    constraint = structured.structured_from_body(body)
    tool_spec = tools.tools_from_body(body, constraint) if chat else None
    if tool_spec is not None and tool_spec.constraint is not None:
        constraint = tool_spec.constraint
    if constraint is not None:
        structured.to_pb(constraint, params)
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise InvalidRequest(
                "stream_options", "<object>", "must be an object with include_usage"
            )
        if not stream:
            raise InvalidRequest("stream_options", "<object>", "is only allowed with stream=true")
        include_usage = bool(_bool(opts, "include_usage"))
        if _bool(opts, "continuous_usage_stats"):  # vLLM's usage on every chunk: not served
            raise InvalidRequest(
                "stream_options.continuous_usage_stats", True, "is not supported (must be false)"
            )
    _str(body, "user")  # accepted for compatibility; not used
    priority = _int(body, "priority") or 0
    if not -(1 << 31) <= priority < 1 << 31:
        raise InvalidRequest("priority", priority, "must be a 32-bit integer")
    base = pb.GenerateRequest(
        params=params,
        cache_salt=_str(body, "cache_salt") or "",
        tenant=tenant or "",
        priority=priority,
    )
    rid = _request_id(body) or uuid.uuid4().hex
    response_id = ("chatcmpl-" if chat else "cmpl-") + rid
    reqs = []
    if chat:
        req = pb.GenerateRequest()
        req.CopyFrom(base)
        req.messages.CopyFrom(_messages(body))
        if tool_spec is not None:
            req.messages.tools = json.dumps(list(tool_spec.tools), ensure_ascii=False)
        req.request_id = response_id[: limits.max_request_id_chars]
        reqs.append(req)
    else:
        prompts = _prompts(body)
        if len(prompts) > limits.max_n:
            raise InvalidRequest(
                "prompt",
                f"<{len(prompts)} prompts>",
                f"must hold at most {limits.max_n} prompts (router.limits.max_n)",
            )
        n = params.n if params.HasField("n") else 1
        if len(prompts) > 1 and len(prompts) * n > limits.max_n:  # one answer holds them all
            raise InvalidRequest(
                "n",
                n,
                f"times {len(prompts)} prompts must be at most {limits.max_n} choices "
                "(router.limits.max_n)",
            )
        for i, p in enumerate(prompts):
            req = pb.GenerateRequest()
            req.CopyFrom(base)
            if isinstance(p, str):
                req.text = p
            else:
                req.token_ids.ids.extend(p)
            suffix = f"-{i}" if len(prompts) > 1 else ""
            req.request_id = response_id[: limits.max_request_id_chars - len(suffix)] + suffix
            reqs.append(req)
    meta = OpenAIRequest(
        chat=chat,
        model=model,
        stream=stream,
        include_usage=include_usage,
        top_logprobs=top_logprobs,
        created=now,
        response_id=response_id,
        tools=tool_spec,
    )
    return meta, reqs


def _logprobs(body: dict, chat: bool, params: pb.SamplingParams) -> int | None:
    """Chat: ``logprobs`` (bool) + ``top_logprobs`` (int); completions: ``logprobs`` (int).
    Returns the alternatives to show per token (None: no logprobs). The engine returns the
    sampled token's logprob only with k >= 1 alternatives, so k is at least 1."""
    if chat:
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs")
        if top is not None and not want:
            raise InvalidRequest("top_logprobs", top, "needs logprobs=true")
        if not want:
            return None
        top = _uint("top_logprobs", top or 0)
    else:
        top = _int(body, "logprobs")
        if top is None:
            return None
        top = _uint("logprobs", top)
    params.logprobs = max(top, 1)
    return top


def to_specs(
    reqs: list[pb.GenerateRequest], *, tenant: str | None, lora: str | None, limits: RequestLimits
) -> list[GenerateSpec]:
    """The shared validator, once per prompt (``lora``: the adapter ``model`` named)."""
    for r in reqs:
        if lora:
            r.lora = lora
    return [spec_from_pb(r, tenant=tenant, limits=limits) for r in reqs]
