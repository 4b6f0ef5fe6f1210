"""Protobuf at the edge: kvcluster.v1 messages <-> the intake's and engine's dataclasses.

Nothing past the servicer sees a protobuf message: :func:`spec_from_pb` builds the intake's
request with the shared validator (:func:`router.serving.generate_spec.make_spec`), whose
:class:`InvalidRequest` (field, value, limit) the servicer maps to INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from kvstore.requests import json_text
from kvstore.requests.errors import InvalidRequest
from kvstore.requests.output_constraint import StructuredOutputs
from kvstore.requests.outputs import FinishReason, RequestOutput, TokenLogprob
from kvstore.requests.sampling_params import WIRE
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.placement.config import RequestLimits
from router.serving.generate_spec import DEFAULT_LIMITS, ChatOptions, GenerateSpec, make_spec

FINISH_TO_PB = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}

_PARAMS = pb.SamplingParams.DESCRIPTOR
EARLY_STOPPING_FROM_PB = {
    pb.EARLY_STOPPING_UNSPECIFIED: None,  # not set: SamplingParams' default
    pb.EARLY_STOPPING_FALSE: False,
    pb.EARLY_STOPPING_TRUE: True,
    pb.EARLY_STOPPING_NEVER: "never",
}
# the sampling fields of pb.SamplingParams, by proto name: SamplingParams' name (from its
# declaration, kvstore.requests.sampling_params.WIRE)
PARAMS_FIELDS = {
    wire.proto.removeprefix("params."): name
    for name, wire in WIRE.items()
    if wire.proto is not None and wire.proto.startswith("params.")
}
# the GenerateRequest fields that carry a sampling field (priority, cache_salt, lora): read
# by spec_from_pb by name, as make_spec takes them
REQUEST_FIELDS = {
    wire.proto: name
    for name, wire in WIRE.items()
    if wire.proto is not None and not wire.proto.startswith("params.")
}


def _field_value(msg: pb.SamplingParams, fd: FieldDescriptor) -> Any:
    """The value ``msg`` sets in ``fd`` as SamplingParams takes it; None: not set."""
    name = fd.name
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        items = getattr(msg, name).items()
        return tuple(sorted(items)) if items else None
    if fd.is_repeated:
        return list(getattr(msg, name)) or None
    if fd.message_type is not None:
        return _MESSAGES[name](getattr(msg, name)) if msg.HasField(name) else None
    if fd.enum_type is not None:
        return _ENUMS[name][getattr(msg, name)]
    return getattr(msg, name) if msg.HasField(name) else None


def _values(msg: pb.SamplingParams) -> dict[str, object]:
    """The sampling fields the client set, by SamplingParams' names (proto3 ``optional``:
    HasField; repeated and map fields: non-empty; enums: not UNSPECIFIED)."""
    values = {}
    for proto_name, name in PARAMS_FIELDS.items():
        value = _field_value(msg, _PARAMS.fields_by_name[proto_name])
        if value is not None:
            values[name] = value
    if values.get("logprobs") == 0:  # the API's "no logprobs"
        values.pop("logprobs")
    return values


def spec_from_pb(
    req: pb.GenerateRequest, *, tenant: str | None = None, limits: RequestLimits = DEFAULT_LIMITS
) -> GenerateSpec:
    """The gRPC parser: a GenerateRequest -> the intake's validated request (model limits
    are checked once it is tokenized). ``tenant``: the authenticated tenant (or the
    request's own, without auth); it scopes the cache salt (see :func:`tenant_salt`)."""
    which = req.WhichOneof("prompt")
    prompt: dict[str, object] = {}
    values = _values(req.params)
    stop = values.pop("stop", [])  # checked by make_spec against the router's limits
    stop_token_ids = values.pop("stop_token_ids", [])
    if which == "messages":
        msgs = req.messages
        prompt["messages"] = [_message(i, m) for i, m in enumerate(msgs.messages)]
        # what the template writes besides the contents (their JSON texts' sizes, as sent)
        rendered = len(msgs.tools) + sum(
            len(m.tool_calls) + len(m.tool_call_id) + len(m.name) for m in msgs.messages
        )
        tools = tools_from_pb(msgs.tools) if msgs.tools else None
        prompt["chat"] = ChatOptions(tools=tools, rendered_chars=rendered)
    elif which == "text":
        prompt["text"] = req.text
    elif which == "token_ids":
        prompt["token_ids"] = list(req.token_ids.ids)
    spec = make_spec(
        request_id=req.request_id,
        tenant=tenant,
        claimed_tenant=req.tenant,
        cache_salt=req.cache_salt,
        values=values,
        stop=stop,
        stop_token_ids=stop_token_ids,
        priority=req.priority,
        lora=req.lora or None,
        stream_text=req.stream_text if req.HasField("stream_text") else True,
        limits=limits,
        **prompt,  # type: ignore[arg-type]
    )
    if req.continue_from:
        spec = replace(spec, continue_from=tuple(req.continue_from))
    return spec


def structured_from_pb(msg: pb.StructuredOutputs) -> StructuredOutputs:
    """The constraint, naming its field (a grammar the library cannot compile is
    INVALID_ARGUMENT naming it: the intake checks it before the request is routed)."""
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
    return spec


# per message-typed and enum-typed field of pb.SamplingParams: its converter
_MESSAGES = {"structured": structured_from_pb}
_ENUMS = {"early_stopping": EARLY_STOPPING_FROM_PB}


def _json_field(field: str, text: str) -> Any:
    return json_text.loads(text, field)


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = _json_field(f"messages[{i}].tool_calls", m.tool_calls)
        if not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls", "<value>", "must be a JSON list")
        out["tool_calls"] = calls
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:  # the author's name, for templates that render it
        out["name"] = m.name
    return out


def tools_from_pb(text: str) -> tuple[dict[str, Any], ...]:
    tools = _json_field("messages.tools", text)
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
            msg.logprobs.extend(top_logprobs_pb(d.logprobs))
        msgs.append(msg)
    if out.prompt_logprobs is not None or out.finished:
        if not msgs:
            msgs.append(pb.GenerateResponse(request_id=out.request_id, worker_id=worker_id))
    if out.prompt_logprobs is not None:  # (on the request's first output only)
        msgs[0].prompt_logprobs.extend(top_logprobs_pb(out.prompt_logprobs))
    if out.finished:
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


def top_logprobs_pb(lps: Sequence[TokenLogprob | None]) -> list[pb.TopLogprobs]:
    """Per token: its own log-probability, then its alternatives' (None: an empty entry,
    the first prompt token's)."""
    out = []
    for lp in lps:
        if lp is None:
            out.append(pb.TopLogprobs())
            continue
        entries = [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob)]
        entries += [pb.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top]
        out.append(pb.TopLogprobs(entries=entries))
    return out


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
