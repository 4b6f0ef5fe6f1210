"""OpenAI request fields from parsed JSON: type checks with OpenAI's field names, the
prompt and message forms, and the fields this server does not serve (a 400 naming them).
``null`` is "not set" for every optional field."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.sampling_params import MAX_LOGIT_BIAS, MAX_SEED
from router.http_api.tools import tool_fields
from router.serving.generate_spec import ChatOptions
from worker.model.tokenizer import CHAT_ROLES


def shown(value: Any, limit: int = 64) -> Any:
    """``value`` as an error message may quote it: long strings by their length only."""
    if isinstance(value, str) and len(value) > limit:
        return f"<{len(value)} chars>"
    return value


def bad_type(name: str, value: Any, kind: str) -> InvalidRequest:
    quoted = value if isinstance(value, int | float | bool | None) else type(value).__name__
    return InvalidRequest(name, quoted, f"must be {kind}")


def get_typed(body: dict, name: str, ok: Callable[[Any], bool], kind: str) -> Any:
    v = body.get(name)
    if v is not None and not ok(v):
        raise bad_type(name, v, kind)
    return v


def get_int(body: dict, name: str) -> int | None:
    return get_typed(
        body, name, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"
    )


def get_float(body: dict, name: str) -> float | None:
    v = get_typed(
        body, name, lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"
    )
    if v is not None and not math.isfinite(v):
        raise InvalidRequest(name, v, "must be a finite number")
    return None if v is None else float(v)


def get_str(body: dict, name: str) -> str | None:
    return get_typed(body, name, lambda v: isinstance(v, str), "a string")


def get_bool(body: dict, name: str) -> bool | None:
    return get_typed(body, name, lambda v: isinstance(v, bool), "true or false")


def token_ids(name: str, value: list) -> list[int]:
    if not all(type(t) is int for t in value):
        raise InvalidRequest(name, "<list>", "must be a list of integer token ids")
    if value and min(value) < 0:
        raise InvalidRequest(name, min(value), "must be a token id >= 0")
    return value


def prompts(body: dict) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, a list of strings, a list of token ids, or a list of
    token-id lists."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [token_ids("prompt", p)]
        if all(isinstance(x, list) for x in p):
            return [token_ids("prompt", x) for x in p]
    if p is None:
        raise InvalidRequest("prompt", None, "is required")
    raise InvalidRequest(
        "prompt",
        "<" + type(p).__name__ + ">",
        "must be a string, a list of strings, a list of token ids or a "
        "list of token-id lists, and not empty",
    )


REASONING_KEYS = ("reasoning", "reasoning_content")


def _reasoning_of(m: dict, name: str) -> str | None:
    """An assistant message's reasoning, as answered before (``reasoning`` or vLLM's older
    ``reasoning_content``)."""
    for key in REASONING_KEYS:
        v = m.get(key)
        if v is not None and not isinstance(v, str):
            raise bad_type(f"{name}.{key}", v, "a string")
        if v:
            return v
    return None


def messages(body: dict) -> list[dict[str, str]]:
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
            raise bad_type(name, m, "an object with role and content")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"{name}.role", shown(role), f"must be one of {', '.join(CHAT_ROLES)}"
            )
        content = m.get("content")
        extras = tool_fields(m, name)  # tool_calls, tool_call_id (router/http_api/tools.py)
        if content is None and extras.get("tool_calls"):
            content = ""
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
            raise bad_type(f"{name}.content", content, "a string or a list of text parts")
        if not isinstance(m.get("name") or "", str):
            raise bad_type(f"{name}.name", m["name"], "a string")
        if m.get("name"):  # the author's name, for templates that render it
            extras["name"] = m["name"]
        reasoning = _reasoning_of(m, name) if role == "assistant" else None
        if reasoning:  # (the template's name for it; vLLM's answers say either)
            extras["reasoning_content"] = reasoning
        extra = sorted(k for k, v in m.items() if v is not None)
        known = (
            "role",
            "content",
            "name",
            *extras,
            *(REASONING_KEYS if role == "assistant" else ()),
        )
        extra = [k for k in extra if k not in known]
        if extra:
            raise InvalidRequest(
                name,
                shown(extra[0]),
                "unknown message field (supported: role, content, name, tool_calls, "
                "tool_call_id; an assistant's reasoning or reasoning_content)",
            )
        out.append({"role": role, "content": content, **extras})
    return out


def stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise bad_type("stop", stop, "a string or a list of strings")


def unserved(body: dict, chat: bool) -> None:
    """Fields that would change the output in a way this server does not serve: a 400,
    never silently ignored, unless they hold the value that means "off"."""
    if body.get("suffix") is not None:
        raise InvalidRequest("suffix", "<str>", "is not supported (must be null)")
    best_of, n = body.get("best_of"), body.get("n") or 1
    if best_of is not None and best_of != n:
        raise InvalidRequest("best_of", best_of, f"must be null or equal n={n}")
    for name in ("functions", "function_call"):  # (the deprecated spelling of tools)
        if body.get(name) is not None:
            raise InvalidRequest(name, "<set>", "is not supported (send tools / tool_choice)")
    if chat and body.get("echo"):
        raise InvalidRequest("echo", True, "is not supported on chat completions")
    beams = "beam search is served on the gRPC API (params.beam_width)"
    if body.get("use_beam_search"):
        raise InvalidRequest("use_beam_search", body["use_beam_search"], f"must be false: {beams}")
    for name, off in (("length_penalty", 1), ("early_stopping", False)):
        if body.get(name) not in (None, off):
            raise InvalidRequest(name, shown(body[name]), f"must be null or {off}: {beams}")


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad_type("logit_bias", bias, "an object of token id -> bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            "logit_bias", f"<{len(bias)} entries>", f"must hold at most {MAX_LOGIT_BIAS} entries"
        )
    out = []
    for key, value in bias.items():
        if not key.isdigit() or len(key) > 12:
            raise InvalidRequest("logit_bias", shown(key), "keys must be token ids (digits)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_type(f"logit_bias[{key}]", value, "a number")
        if not -100 <= value <= 100:
            raise InvalidRequest(f"logit_bias[{key}]", value, "must be in [-100, 100]")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def allowed_token_ids(body: dict) -> tuple[int, ...]:
    """vLLM's allowed_token_ids: a non-empty list of token ids (null: every id)."""
    ids = body.get("allowed_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not ids:
        raise bad_type("allowed_token_ids", ids, "a non-empty list of token ids")
    return tuple(token_ids("allowed_token_ids", ids))


def bad_words(body: dict) -> tuple[str, ...]:
    """vLLM's bad_words: a list of strings (null: none)."""
    words = body.get("bad_words")
    if words is None:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise bad_type("bad_words", words, "a list of strings")
    return tuple(words)


def seed(body: dict) -> int | None:
    """OpenAI allows any 64-bit seed; the engine's RNG takes [0, 2**63): a negative seed
    maps to its two's complement there (deterministic, as a seed must be)."""
    seed = get_int(body, "seed")
    if seed is None:
        return None
    if not -(1 << 63) <= seed <= MAX_SEED:
        raise InvalidRequest("seed", seed, f"must be a 64-bit integer in [-2**63, {MAX_SEED}]")
    return seed + (1 << 63) if seed < 0 else seed


# OpenAI's reasoning_effort values; the chat template reads it (gpt-oss's does)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def chat_options(body: dict) -> ChatOptions:
    kwargs = get_typed(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
    add = get_bool(body, "add_generation_prompt")
    cont = bool(get_bool(body, "continue_final_message"))
    template_kwargs = dict(kwargs or {})
    effort = get_str(body, "reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise InvalidRequest(
                "reasoning_effort", shown(effort), f"must be one of {', '.join(REASONING_EFFORTS)}"
            )
        template_kwargs.setdefault("reasoning_effort", effort)
    return ChatOptions(
        add_generation_prompt=(not cont) if add is None else add,
        continue_final_message=cont,
        template_kwargs=template_kwargs,
    )
