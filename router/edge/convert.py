"""Protobuf at the edge: kvcluster.v1 messages <-> the engine's and router's dataclasses.

Nothing past the servicer sees a protobuf message. Every rule broken raises the engine's
:class:`InvalidRequest` (field, value, limit), which the servicer maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvstore.blocks.errors import InvalidRequest
from kvstore.blocks.hashing import SALT_SCOPE_SEP
from kvstore.blocks.outputs import FinishReason, RequestOutput
from kvstore.blocks.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from kvstore.blocks.structured import StructuredOutputs
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.placement.config import RequestLimits

if TYPE_CHECKING:
    from worker.model.tokenizer import Tokenizer

DEFAULT_LIMITS = RequestLimits()

FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}

_OPTIONAL_PARAMS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "n",
    "beam_width",
    "length_penalty",
    "ignore_eos",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """A validated Generate request, protobuf-free."""

    request_id: str  # client's id or a generated one
    text: str | None  # the prompt text (None when token ids were sent)
    token_ids: list[int] | None  # the prompt's token ids (None until tokenized, for text)
    params: SamplingParams  # validated sampling parameters (cache_salt, priority folded in)
    tenant: str  # tenant name ("" = anonymous)
    stream_text: bool  # send text deltas (else token ids only)
    # chat messages as ({"role", "content"}, ...) when the prompt is a conversation; the
    # serving edge renders them with the model's chat template into ``text``'s place
    messages: tuple[dict[str, Any], ...] | None = None
    # the tools a chat may call (OpenAI tool objects), for the chat template
    tools: tuple[dict[str, Any], ...] | None = None


def _check_str(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidRequest(field, f"<{len(value)} chars>", f"must be at most {limit} characters")


def params_from_pb(
    msg: pb.SamplingParams,
    *,
    priority: int,
    cache_salt: str | None,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> SamplingParams:
    values: dict[str, object] = {}
    for name in _OPTIONAL_PARAMS:
        if msg.HasField(name):
            v = getattr(msg, name)
            if isinstance(v, float) and not math.isfinite(v):
                raise InvalidRequest(name, v, "must be a finite number")
            values[name] = v
    if values.get("top_k") == 0:
        values["top_k"] = None
    if values.get("logprobs") == 0:
        values.pop("logprobs")
    for name, key in (("n", "max_n"), ("beam_width", "max_n"), ("logprobs", "max_logprobs")):
        limit = getattr(limits, key)
        if values.get(name, 0) > limit:  # type: ignore[operator]
            raise InvalidRequest(
                name, values[name], f"must be at most {limit} (router.limits.{key})"
            )
    if len(msg.stop) > limits.max_stop_strings:
        raise InvalidRequest(
            "stop",
            f"<{len(msg.stop)} strings>",
            f"must be at most {limits.max_stop_strings} strings",
        )
    for s in msg.stop:
        _check_str("stop", s, limits.max_stop_string_chars)
    values["stop"] = tuple(msg.stop)
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # before copying them
        raise InvalidRequest(
            "stop_token_ids",
            f"<{len(msg.stop_token_ids)} ids>",
            f"must hold at most {MAX_STOP_TOKEN_IDS} token ids",
        )
    values["stop_token_ids"] = tuple(msg.stop_token_ids)
    values["priority"] = priority
    values["cache_salt"] = cache_salt
    if msg.HasField("structured"):
        values["structured"] = structured_from_pb(msg.structured)
    return SamplingParams(**values)


def structured_from_pb(msg: pb.StructuredOutputs) -> StructuredOutputs:
    """The constraint, checked by the grammar library (a grammar it cannot compile is
    INVALID_ARGUMENT naming the field, before the request is routed)."""
    which = msg.WhichOneof("kind")
    field = f"params.structured.{which}"
    if which is None:
        raise InvalidRequest("params.structured", None, "set one of its kinds")
    if which == "json_schema":
        spec = StructuredOutputs.json_schema(msg.json_schema, field)
    elif which == "choice":
        spec = StructuredOutputs.choice(list(msg.choice.choices), field)
    elif which == "json_object":
        spec = StructuredOutputs("json_object", "", field)
    else:
        spec = StructuredOutputs(which, getattr(msg, which), field)
    spec.check()
    return spec


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


def spec_from_pb(
    req: pb.GenerateRequest, *, tenant: str | None = None, limits: RequestLimits = DEFAULT_LIMITS
) -> GenerateSpec:
    """Validate and convert a GenerateRequest (model limits are checked later, by the caller).

    ``tenant``: the authenticated tenant (or the request's own, without auth); it scopes the
    cache salt (see :func:`tenant_salt`).
    """
    _check_str("request_id", req.request_id, limits.max_request_id_chars)
    if not req.request_id.isprintable():  # it is logged: no forged lines, no escapes
        shown = req.request_id.encode("unicode_escape").decode()
        raise InvalidRequest("request_id", shown, "must not contain control characters")
    _check_str("tenant", req.tenant, limits.max_tenant_chars)
    if SALT_SCOPE_SEP in req.tenant:  # it separates a tenant's name from its salts
        raise InvalidRequest("tenant", req.tenant, f"must not contain {SALT_SCOPE_SEP!r}")
    _check_str("cache_salt", req.cache_salt, limits.max_cache_salt_chars)
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt", None, "set exactly one of text, token_ids or messages")
    text = token_ids = messages = tools = None
    if which == "messages":
        messages = messages_from_pb(req.messages, limits)
        tools = tools_from_pb(req.messages)
    elif which == "text":
        if not req.text:
            raise InvalidRequest("text", "", "must be a non-empty string")
        _check_str("text", req.text, limits.max_prompt_chars)
        text = req.text
    else:
        token_ids = list(req.token_ids.ids)
        if not token_ids:
            raise InvalidRequest("token_ids", [], "must hold at least one token id")
    salt = tenant_salt(tenant, req.cache_salt)
    params = params_from_pb(req.params, priority=req.priority, cache_salt=salt, limits=limits)
    if req.lora:
        _check_str("lora", req.lora, 64)
        params = replace(params, lora=req.lora)
    return GenerateSpec(
        request_id=req.request_id or uuid.uuid4().hex,
        text=text,
        token_ids=token_ids,
        params=params,
        tenant=req.tenant,
        stream_text=req.stream_text if req.HasField("stream_text") else True,
        messages=messages,
        tools=tools,
    )


def messages_from_pb(
    msg: pb.ChatMessages, limits: RequestLimits = DEFAULT_LIMITS
) -> tuple[dict[str, str], ...]:
    """Chat messages as dicts; the roles and contents are checked when the template is
    rendered (``Tokenizer.render_chat``), the total size here."""
    if not msg.messages:
        raise InvalidRequest("messages", [], "must hold at least one message")
    total = sum(len(m.content) for m in msg.messages)
    if total > limits.max_prompt_chars:
        raise InvalidRequest(
            "messages",
            f"<{total} chars>",
            f"must be at most {limits.max_prompt_chars} characters in all",
        )
    return tuple(_message(i, m) for i, m in enumerate(msg.messages))


def _json_field(field: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(field, f"<{len(text)} chars>", f"is not JSON: {exc}") from None


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = _json_field(f"messages[{i}].tool_calls", m.tool_calls)
        if not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls", "<value>", "must be a JSON list")
        out["tool_calls"] = calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def tools_from_pb(msg: pb.ChatMessages) -> tuple[dict[str, Any], ...] | None:
    if not msg.tools:
        return None
    tools = _json_field("messages.tools", msg.tools)
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequest("messages.tools", "<value>", "must be a JSON list of tool objects")
    return tuple(tools)


def responses_from_output(
    out: RequestOutput, *, worker_id: str, stream_text: bool
) -> list[pb.GenerateResponse]:
    """One engine output -> one GenerateResponse per changed sample; usage on the last."""
    msgs = []
    for d in out.outputs:
        msg = pb.GenerateResponse(
            request_id=out.request_id,
            index=d.index,
            token_ids=d.token_ids,
            text=d.text if stream_text else "",
            finish_reason=FINISH_TO_PB[d.finish_reason],
            worker_id=worker_id,
        )
        if d.logprobs:
            for lp in d.logprobs:
                entries = [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob)]
                entries += [pb.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top]
                msg.logprobs.append(pb.TopLogprobs(entries=entries))
        msgs.append(msg)
    if out.finished:
        if not msgs:
            msgs.append(pb.GenerateResponse(request_id=out.request_id, worker_id=worker_id))
        u = out.usage
        msgs[-1].usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                cached_tokens=u.cached_tokens,
                completion_tokens=u.completion_tokens,
                host_cached_tokens=u.host_cached_tokens,
            )
        )
    return msgs


def malformed_reason(descriptor: Descriptor, data: bytes, error: Exception) -> str:
    """Why ``data`` does not parse as ``descriptor``'s message, naming the field when it is a
    string field with invalid UTF-8 (proto3 requires UTF-8; protobuf does not say which)."""
    field = _bad_utf8_field(descriptor, data)
    if field is not None:
        return (
            f"invalid {field}: not valid UTF-8 (proto3 string fields must be UTF-8; "
            "send token_ids for arbitrary input)"
        )
    return f"request is not a valid {descriptor.full_name} ({len(data)} bytes): {error}"


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        if pos >= len(data):
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("varint over 10 bytes")


def _bad_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """Dotted name of the first string field of ``data`` (wire format) that is not UTF-8;
    None when there is none or the wire format itself is corrupt."""
    pos = 0
    try:
        while pos < len(data):
            tag, pos = _varint(data, pos)
            wire = tag & 7
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 2:
                size, pos = _varint(data, pos)
                chunk, pos = data[pos : pos + size], pos + size
                field = descriptor.fields_by_number.get(tag >> 3)
                if field is None:
                    continue
                name = prefix + field.name
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = _bad_utf8_field(field.message_type, chunk, name + ".")
                    if found is not None:
                        return found
            else:
                return None
    except ValueError:
        return None
    return None


def chat_token_ids(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Render a conversation with the model's chat template (plus the assistant's turn
    prefix) and tokenize it; a bad message or a model without a template is the client's
    error (INVALID_ARGUMENT naming the message)."""
    try:
        if tools:
            return tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools)
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    except ValueError as exc:
        raise InvalidRequest("messages", f"<{len(messages)} messages>", str(exc)) from exc
