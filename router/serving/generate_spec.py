"""The intake's request type and its one validator, shared by the gRPC and HTTP parsers.

Each parser turns its wire form into plain Python values (checking only what its format
adds: JSON types, protobuf's oneof) and calls :func:`make_spec`, which checks every range
and limit and names a bad field as the client's API spells it (``names``).
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.blocks.hashing import SALT_SCOPE_SEP
from kvstore.requests.errors import InvalidRequest
from kvstore.requests.output_constraint import StructuredOutputs
from kvstore.requests.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from router.placement.config import RequestLimits
from router.serving.request_errors import renamed
from worker.model.tokenizer import MESSAGE_KEYS

DEFAULT_LIMITS = RequestLimits()
MAX_TEMPLATE_KWARGS_CHARS = 4096  # chat_template_kwargs, as JSON: flags, not content


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a conversation is rendered with the model's chat template."""

    add_generation_prompt: bool = True  # open the assistant's turn after the messages
    continue_final_message: bool = False  # leave the last (assistant) message open
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra template vars
    tools: tuple[dict[str, Any], ...] | None = None  # OpenAI tool objects for the template
    # what the template writes into the prompt besides the messages' contents (the tools
    # and past tool calls, as JSON text, and the calls' ids): it counts against the
    # prompt's character cap with the contents, before anything is rendered
    rendered_chars: int = 0


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """A validated generation request, protocol-free."""

    request_id: str  # client's id or a generated one (a label: workers see the router's own)
    text: str | None  # the prompt text (None when token ids or messages were sent)
    token_ids: list[int] | None  # the prompt's token ids (None until tokenized, for text)
    params: SamplingParams  # validated sampling parameters (cache_salt, priority folded in)
    tenant: str  # the tenant it runs for: the bearer token's, or the client's claim without
    # auth ("" = anonymous); it scopes the cache salt and which adapters it may use
    stream_text: bool = True  # send text deltas (else token ids only)
    # chat messages as ({"role", "content"}, ...) when the prompt is a conversation; the
    # intake renders them with the model's chat template
    messages: tuple[dict[str, str], ...] | None = None
    chat: ChatOptions = ChatOptions()  # how ``messages`` are rendered
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # grammars the library must compile before the request is routed (its output
    # constraint, a chat's tool schemas); the intake checks them off the event loop
    grammars: tuple[StructuredOutputs, ...] = ()
    # output tokens the client already has (it resumes a stream whose router died): the
    # request continues after them
    continue_from: tuple[int, ...] = ()
    # the client set max_tokens: more than the prompt leaves of the context is refused (as
    # vLLM and SGLang do); unset, the default is cut to what the context leaves
    max_tokens_given: bool = False
    # unset max_tokens means as many as the context leaves (OpenAI's chat), not the default
    fill_context: bool = False
    # a conversation over the context loses its oldest turns, its system messages kept
    # (the Responses API's truncation "auto"), rather than being refused
    drop_turns: bool = False
    # the client's spelling of the intake's field names, for errors raised after parsing
    names: Mapping[str, str] = field(default_factory=dict, compare=False)


def check_str(name: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequest(name, f"<{len(value)} chars>", f"must be at most {limit} characters")


def check_request_id(name: str, rid: str, limits: RequestLimits) -> None:
    """A client's id is logged and echoed in headers: bounded, printable ASCII."""
    check_str(name, rid, limits.max_request_id_chars)
    if not all(" " <= ch <= "~" for ch in rid):
        shown = rid.encode("unicode_escape").decode()
        raise InvalidRequest(name, shown, "must be printable ASCII (no control characters)")


def tenant_salt(tenant: str | None, cache_salt: str) -> str | None:
    """The salt folded into block 0's key: a tenant's requests never share KV (or a routing
    signal) with another tenant's, whatever ``cache_salt`` they send.

    No tenant: ``salt:`` and a digest of the client's salt (None when empty), a namespace of
    its own, so no client salt (``"tenant:X"`` say) can name tenant X's KV. A tenant:
    ``tenant:<name>``, plus a digest of the client's salt when one is set (so a client cannot
    pick another tenant's salt). Digests keep the result within SamplingParams' 256 characters.
    """
    digest = hashlib.sha256(cache_salt.encode()).hexdigest()[:32]
    if not tenant:
        return f"salt:{digest}" if cache_salt else None
    if not cache_salt:
        return f"tenant:{tenant}"
    return f"tenant:{tenant}{SALT_SCOPE_SEP}{digest}"


def sampling_params(
    values: dict[str, Any],
    *,
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    priority: int,
    cache_salt: str | None,
    limits: RequestLimits,
) -> SamplingParams:
    """``values``: the optional sampling fields the client set (SamplingParams' names)."""
    values = dict(values)
    for name, v in values.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise InvalidRequest(name, v, "must be a finite number")
    if values.get("top_k") in (0, -1):
        values["top_k"] = None
    for name, key in (
        ("n", "max_n"),
        ("beam_width", "max_n"),
        ("logprobs", "max_logprobs"),
        ("prompt_logprobs", "max_logprobs"),
    ):
        limit = getattr(limits, key)
        if (values.get(name) or 0) > limit:
            raise InvalidRequest(
                name, values[name], f"must be at most {limit} (router.limits.{key})"
            )
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest(
            "stop", f"<{len(stop)} strings>", f"must be at most {limits.max_stop_strings} strings"
        )
    for s in stop:
        check_str("stop", s, limits.max_stop_string_chars)
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:  # before copying them
        raise InvalidRequest(
            "stop_token_ids",
            f"<{len(stop_token_ids)} ids>",
            f"must hold at most {MAX_STOP_TOKEN_IDS} token ids",
        )
    return SamplingParams(
        **values,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_token_ids),
        priority=priority,
        cache_salt=cache_salt,
    )


def make_spec(
    *,
    request_id: str,
    tenant: str | None,
    claimed_tenant: str = "",
    cache_salt: str = "",
    text: str | None = None,
    token_ids: list[int] | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    values: dict[str, Any],
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    priority: int = 0,
    lora: str | None = None,
    stream_text: bool = True,
    chat: ChatOptions | None = None,
    truncate_prompt_tokens: int | None = None,
    limits: RequestLimits = DEFAULT_LIMITS,
    names: Mapping[str, str] | None = None,
    grammars: Sequence[StructuredOutputs] = (),
    fill_context: bool = False,
    drop_turns: bool = False,
) -> GenerateSpec:
    """Validate one request (model limits are checked once it is tokenized). ``tenant``: the
    authenticated tenant (or the client's own claim, without auth); it scopes the cache salt
    (see :func:`tenant_salt`). Exactly one of ``text``, ``token_ids``, ``messages``.
    ``grammars``: schemas to compile-check besides the output constraint (``values``'
    ``structured``), such as a chat's tool parameters. ``fill_context``: without
    ``max_tokens`` the request may generate as long as the context allows; ``drop_turns``:
    a conversation over the context loses its oldest turns."""
    names = dict(names or {})
    try:
        spec = _make_spec(
            request_id,
            tenant,
            claimed_tenant,
            cache_salt,
            text,
            token_ids,
            messages,
            values,
            stop,
            stop_token_ids,
            priority,
            lora,
            stream_text,
            chat or ChatOptions(),
            truncate_prompt_tokens,
            limits,
            names,
            tuple(grammars),
        )
    except InvalidRequest as exc:
        raise renamed(exc, names) from None
    return replace(
        spec,
        max_tokens_given="max_tokens" in values,
        fill_context=fill_context,
        drop_turns=drop_turns,
    )


def _make_spec(  # noqa: PLR0913 - the fields of one request
    request_id: str,
    tenant: str | None,
    claimed: str,
    cache_salt: str,
    text: str | None,
    token_ids: list[int] | None,
    messages: Sequence[Mapping[str, str]] | None,
    values: dict[str, Any],
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    priority: int,
    lora: str | None,
    stream_text: bool,
    chat: ChatOptions,
    truncate: int | None,
    limits: RequestLimits,
    names: dict[str, str],
    grammars: tuple[StructuredOutputs, ...],
) -> GenerateSpec:
    check_request_id("request_id", request_id, limits)
    check_str("tenant", claimed, limits.max_tenant_chars)
    if SALT_SCOPE_SEP in claimed:  # it separates a tenant's name from its salts
        raise InvalidRequest("tenant", claimed, f"must not contain {SALT_SCOPE_SEP!r}")
    check_str("cache_salt", cache_salt, limits.max_cache_salt_chars)
    if not -(1 << 31) <= priority < 1 << 31:
        raise InvalidRequest("priority", priority, "must be a 32-bit integer")
    forms = sum(x is not None for x in (text, token_ids, messages))
    if forms != 1:
        raise InvalidRequest("prompt", None, "set exactly one of text, token_ids or messages")
    msgs = None
    if messages is not None:
        msgs = _messages(messages, limits)
    elif text is not None:
        if not text:
            raise InvalidRequest("text", "", "must be a non-empty string")
        check_str("text", text, limits.max_prompt_chars)
    elif not token_ids:
        raise InvalidRequest("token_ids", [], "must hold at least one token id")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise InvalidRequest(
            "truncate_prompt_tokens", truncate, "must be -1 (the model's limit) or >= 1"
        )
    if len(str(chat.template_kwargs)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequest(
            "chat_template_kwargs", "<object>", f"must be at most {MAX_TEMPLATE_KWARGS_CHARS} chars"
        )
    if chat.continue_final_message and chat.add_generation_prompt:
        raise InvalidRequest("continue_final_message", True, "needs add_generation_prompt=false")
    salt = tenant_salt(tenant, cache_salt)
    values = dict(values)
    if lora:
        check_str("lora", lora, 64)
        values["lora"] = lora
    params = sampling_params(
        values,
        stop=stop,
        stop_token_ids=stop_token_ids,
        priority=priority,
        cache_salt=salt,
        limits=limits,
    )
    return GenerateSpec(
        request_id=request_id or uuid.uuid4().hex,
        text=text,
        token_ids=list(token_ids) if token_ids is not None else None,
        params=params,
        tenant=tenant or "",
        stream_text=stream_text,
        messages=msgs,
        chat=chat,
        truncate_prompt_tokens=truncate,
        grammars=(params.structured, *grammars) if params.structured else grammars,
        names=names,
    )


def _messages(
    messages: Sequence[Mapping[str, str]], limits: RequestLimits
) -> tuple[dict[str, str], ...]:
    """Chat messages as dicts; the roles and contents are checked when the template is
    rendered (``Tokenizer.render_chat``), the total size here."""
    if not messages:
        raise InvalidRequest("messages", [], "must hold at least one message")
    total = sum(len(m["content"]) for m in messages)
    if total > limits.max_prompt_chars:
        raise InvalidRequest(
            "messages",
            f"<{total} chars>",
            f"must be at most {limits.max_prompt_chars} characters in all",
        )
    return tuple({k: m[k] for k in MESSAGE_KEYS if k in m} for m in messages)
