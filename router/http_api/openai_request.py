"""OpenAI request bodies (parsed JSON) -> the intake's requests, directly.

This parser checks only what JSON adds (an object, JSON types, OpenAI's spellings such as
``stop`` as a string, which fields exist); every range and limit is checked by the shared
validator (:func:`router.serving.generate_spec.make_spec`), which names a field as this API
spells it. ``null`` means "not set" for every optional field. Fields this server does not
know are accepted and ignored, as vLLM does (the caller logs and counts them); fields it
knows but cannot honour with the value given are a 400. The sampling fields it knows, and
their OpenAI names, are SamplingParams' (:data:`kvstore.requests.sampling_params.WIRE`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, fields, replace
from typing import Any

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.sampling_params import WIRE, SamplingParams
from router.http_api import fields as F
from router.http_api import structured_fields, tools
from router.placement.config import RequestLimits
from router.serving.generate_spec import GenerateSpec, check_request_id, make_spec

# SamplingParams' fields read from OpenAI bodies by the code below, each in its own way
# (OpenAI's spelling, type or range differs from the field's); every other field that the
# HTTP API takes (its Wire has OpenAI names) is read by its type, under its own name
_OWN_PARSER = frozenset(
    {
        "max_tokens",  # or max_completion_tokens (chat)
        "seed",  # any 64-bit integer
        "logprobs",  # chat: logprobs (bool) + top_logprobs
        "prompt_logprobs",  # also implied by echo with logprobs
        "stop",  # a string or a list
        "stop_token_ids",
        "logit_bias",  # an object of token id -> bias
        "allowed_token_ids",  # a list of token ids
        "bad_words",  # a list of strings
        "priority",
        "cache_salt",  # scoped by the tenant
        "lora",  # the model's name
        "structured",  # router.http_api.structured_fields
    }
)
_GETTERS = {"int": F.get_int, "int | None": F.get_int, "float": F.get_float, "bool": F.get_bool}
# by type: SamplingParams' name -> the getter of its annotation's JSON type
_TYPED = {
    f.name: _GETTERS[str(f.type)]
    for f in fields(SamplingParams)
    if f.init and WIRE[f.name].openai and f.name not in _OWN_PARSER
}
# the OpenAI names of the sampling fields (plus the chat-only ones)
SAMPLING_FIELDS = frozenset(n for w in WIRE.values() for n in w.openai)
SAMPLING_CHAT_FIELDS = frozenset(n for w in WIRE.values() for n in w.chat)
# vLLM's beam search fields: refused unless off (F.unserved), beam search is gRPC's
BEAM_FIELDS = frozenset({"use_beam_search", "length_penalty", "early_stopping"})
# known fields that do not change the output (accepted as sent)
_ACCEPTED = ("user", "store", "metadata", "service_tier")
# the request's other fields: its prompt, the answer's shape, its id
_COMMON = frozenset(
    {
        "stream",
        "stream_options",
        "request_id",
        "best_of",
        "truncate_prompt_tokens",
        "return_tokens_as_token_ids",
        "return_token_ids",
        *BEAM_FIELDS,
        *_ACCEPTED,
        *SAMPLING_FIELDS,
    }
)
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix"}
CHAT_FIELDS = (
    _COMMON
    | SAMPLING_CHAT_FIELDS
    | {
        "messages",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        *tools.FIELDS,
        "functions",
        "function_call",
        "echo",
        "include_reasoning",
        "reasoning_effort",
    }
)


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
    echo: bool = False  # completions: the prompt before its completion (with logprobs:
    # its tokens' logprobs before the completion's, as lm-eval's log-likelihoods read them)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token
    token_ids_as_text: bool = False  # return_tokens_as_token_ids: "token_id:<id>" strings
    # vLLM's return_token_ids: each choice's token ids (a chunk's: its new ones) and the
    # prompt's (completions: on each choice; chat: on the answer; streamed: the first chunk)
    return_token_ids: bool = False
    tools: tools.ToolSpec | None = None  # chat: the request's tools and tool_choice
    # chat with a reasoning model: its reasoning answered apart (vLLM's include_reasoning;
    # false: dropped), the content without it either way
    include_reasoning: bool = True


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
    model = F.get_str(body, "model")
    if model == "":
        raise InvalidRequest("model", "", "must be a model name (see GET /v1/models)")
    F.unserved(body, chat)
    names = {"text": "prompt", "token_ids": "prompt"}
    values: dict[str, Any] = {}
    legacy = F.get_int(body, "max_tokens")  # checked even when max_completion_tokens wins
    newer = F.get_int(body, "max_completion_tokens") if chat else None
    for name, v in (("max_tokens", legacy), ("max_completion_tokens", newer)):
        if v is not None and v < 1:
            raise InvalidRequest(name, v, "must be an integer >= 1")
    if newer is not None:
        names["max_tokens"] = "max_completion_tokens"
    if (newer or legacy) is not None:
        values["max_tokens"] = newer or legacy
    for name, get in _TYPED.items():
        if (v := get(body, name)) is not None:
            values[name] = v
    if (seed := F.seed(body)) is not None:
        values["seed"] = seed
    if bias := F.logit_bias(body):
        values["logit_bias"] = bias
    if allowed := F.allowed_token_ids(body):
        values["allowed_token_ids"] = allowed
    if words := F.bad_words(body):
        values["bad_words"] = words
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not isinstance(stop_ids, list):
        raise F.bad_type("stop_token_ids", stop_ids, "a list of token ids")
    top_logprobs = _logprobs(body, chat, values, names)
    echo = bool(F.get_bool(body, "echo")) and not chat
    prompt_logprobs = F.get_int(body, "prompt_logprobs")
    if prompt_logprobs is not None and prompt_logprobs < 0:
        raise InvalidRequest("prompt_logprobs", prompt_logprobs, "must be >= 0")
    wanted = [k for k in (prompt_logprobs, top_logprobs if echo else None) if k is not None]
    if wanted:  # the engine computes the prompt whole, with the most alternatives asked
        values["prompt_logprobs"] = max(wanted)
    constraint = structured_fields.structured_from_body(body)
    tool_spec = tools.tools_from_body(body, constraint) if chat else None
    if tool_spec is not None and tool_spec.constraint is not None:
        constraint = tool_spec.constraint
    if constraint is not None:
        values["structured"] = constraint
    stream = bool(F.get_bool(body, "stream"))
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise InvalidRequest(
                "stream_options", "<object>", "must be an object with include_usage"
            )
        if not stream:
            raise InvalidRequest("stream_options", "<object>", "is only allowed with stream=true")
        include_usage = bool(F.get_bool(opts, "include_usage"))
        continuous = bool(F.get_bool(opts, "continuous_usage_stats"))
    for name in ("user", "service_tier"):
        F.get_str(body, name)
    F.get_bool(body, "store")
    F.get_typed(body, "metadata", lambda v: isinstance(v, dict), "an object")
    truncate = F.get_int(body, "truncate_prompt_tokens")
    if header_request_id is not None:  # echoed in the answer's header too
        check_request_id("x-request-id", header_request_id, limits)
    rid = F.get_str(body, "request_id")
    if rid is not None:
        check_request_id("request_id", rid, limits)
    rid = rid or header_request_id or uuid.uuid4().hex
    response_id = ("chatcmpl-" if chat else "cmpl-") + rid
    common = dict(
        request_id=rid,
        tenant=tenant,
        claimed_tenant=tenant or "",
        cache_salt=F.get_str(body, "cache_salt") or "",
        values=values,
        stop=F.stop(body),
        stop_token_ids=F.token_ids("stop_token_ids", stop_ids or []),
        priority=F.get_int(body, "priority") or 0,
        truncate_prompt_tokens=truncate,
        limits=limits,
        names=names,
    )
    if chat:
        specs = [
            make_spec(
                messages=(msgs := F.messages(body)),
                chat=tools.chat_options(F.chat_options(body), tool_spec, msgs),
                grammars=tool_spec.schemas if tool_spec is not None else (),
                fill_context=True,  # OpenAI's chat default: what the context allows
                **common,  # type: ignore[arg-type]
            )
        ]
        specs[0] = _labelled(specs[0], response_id)
    else:
        prompts = F.prompts(body)
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
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        token_ids_as_text=bool(F.get_bool(body, "return_tokens_as_token_ids")),
        return_token_ids=bool(F.get_bool(body, "return_token_ids")),
        tools=tool_spec,
        include_reasoning=chat and F.get_bool(body, "include_reasoning") is not False,
    )
    return meta, specs


def _labelled(spec: GenerateSpec, label: str) -> GenerateSpec:
    """The answer's id as the request's label (the id itself was checked as sent)."""
    return replace(spec, request_id=label)


def _logprobs(body: dict, chat: bool, values: dict, names: dict) -> int | None:
    """Chat: ``logprobs`` (bool) + ``top_logprobs`` (int); completions: ``logprobs`` (int).
    Returns the alternatives to show per token (None: no logprobs)."""
    if chat:
        want = F.get_bool(body, "logprobs")
        top = F.get_int(body, "top_logprobs")
        if top is not None and not want:
            raise InvalidRequest("top_logprobs", top, "needs logprobs=true")
        if not want:
            return None
        top = top or 0
        names["logprobs"] = "top_logprobs"
    else:
        top = F.get_int(body, "logprobs")
        if top is None:
            return None
    if top < 0:
        raise InvalidRequest(names.get("logprobs", "logprobs"), top, "must be >= 0")
    values["logprobs"] = top
    return top
