"""OpenAI Responses API bodies (``POST /v1/responses``) -> the intake's request.

A response is a chat turn: ``instructions`` become the system message, ``input`` (a string,
or a list of items: messages with text parts, earlier ``function_call`` items and their
``function_call_output``) the conversation, ``tools`` (flat function tools) and
``tool_choice`` the chat's, ``text.format`` its output constraint. The request is
validated by the shared validator (:func:`router.serving.generate_spec.make_spec`), each
error naming the field as this API spells it.

With the response store (the cluster's Redis, ``router.responses_ttl_s`` > 0) a response
is kept unless ``store`` is false, and ``previous_response_id`` continues a kept one: its
conversation (without its instructions, as OpenAI's API has it) comes before ``input``.
Without it ``store`` is answered false and ``previous_response_id`` is refused.
``conversation`` objects are not served.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvstore.requests.errors import InvalidRequest
from router.http_api import fields as F
from router.http_api import structured_fields, tools
from router.placement.config import RequestLimits
from router.serving.generate_spec import ChatOptions, GenerateSpec, check_request_id, make_spec
from router.serving.request_errors import renamed

# what a text part of an input message may be called (an assistant's earlier answer is
# output_text)
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = ("user", "system", "developer", "assistant")
FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "store",
        "metadata",
        "user",
        "truncation",
        "reasoning",
        "include",
        "top_logprobs",
        "service_tier",
        "background",
        "previous_response_id",
        "conversation",
    }
)


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """How one /v1/responses answer is shaped, and the request fields it echoes."""

    model: str  # the name answered with (the client's, or the base model's when omitted)
    stream: bool  # answer with typed server-sent events
    response_id: str  # "resp_..."
    created: int  # unix time of arrival
    tools: tools.ToolSpec | None  # the request's function tools and tool_choice
    top_logprobs: int | None  # the answer's token logprobs and alternatives (None: none)
    echoed: dict[str, Any]  # the request's settings as the response object repeats them
    store: bool  # keep the response (asked, and a store is there)
    previous_response_id: str | None  # the kept response it continues
    # the conversation it answers, earlier turns included, without its instructions: what
    # a kept response holds (with its answer) for the next one
    conversation: list[dict[str, Any]]


def parse_responses(
    body: Any,
    *,
    tenant: str | None,
    limits: RequestLimits,
    now: int,
    header_request_id: str | None = None,
    can_store: bool = False,
    history: list[dict[str, Any]] | None = None,
) -> tuple[ResponsesRequest, GenerateSpec]:
    """Check a Responses body and build the intake request it stands for; the caller
    resolves ``model`` to an adapter. Raises InvalidRequest naming the field.
    ``can_store``: a response store is there; ``history``: the conversation of the kept
    response ``previous_response_id`` names (the caller reads it, then parses again)."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", type(body).__name__, "must be a JSON object")
    model = F.get_str(body, "model")
    if model == "":
        raise InvalidRequest("model", "", "must be a model name (see GET /v1/models)")
    if body.get("conversation") is not None:
        raise InvalidRequest(
            "conversation",
            F.shown(body["conversation"]),
            "is not supported: continue a response with previous_response_id, or send the "
            "whole conversation as input",
        )
    previous = F.get_str(body, "previous_response_id")
    if previous is not None and not can_store:
        raise InvalidRequest(
            "previous_response_id",
            F.shown(previous),
            "is not supported: this cluster stores no responses (it needs Redis and "
            "router.responses_ttl_s > 0); send the whole conversation as input",
        )
    store = F.get_bool(body, "store")
    store = can_store and store is not False  # (OpenAI's default: kept)
    if body.get("background"):
        raise InvalidRequest("background", True, "is not supported: stream the response instead")
    values: dict[str, Any] = {}
    max_out = F.get_int(body, "max_output_tokens")
    if max_out is not None:
        if max_out < 1:
            raise InvalidRequest("max_output_tokens", max_out, "must be an integer >= 1")
        values["max_tokens"] = max_out
    for name in ("temperature", "top_p"):
        if (v := F.get_float(body, name)) is not None:
            values[name] = v
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise F.bad_type("include", include, "a list of strings")
    top = F.get_int(body, "top_logprobs")
    if LOGPROBS in include:  # (top_logprobs alone returns none, as OpenAI's API)
        values["logprobs"] = top or 0
    constraint = text_format = _text_format(body.get("text"))
    tool_spec = _tools(body, constraint)
    if tool_spec is not None and tool_spec.constraint is not None:
        constraint = tool_spec.constraint
    if constraint is not None:
        values["structured"] = constraint
    conversation = [*(history or []), *_input(body.get("input"))]
    msgs = [*_instructions(body), *conversation]
    effort = _effort(body)
    stream = bool(F.get_bool(body, "stream"))
    metadata = F.get_typed(body, "metadata", lambda v: isinstance(v, dict), "an object")
    F.get_str(body, "user")
    truncation = F.get_str(body, "truncation") or "disabled"
    if truncation not in ("disabled", "auto"):
        raise InvalidRequest("truncation", truncation, "must be 'disabled' or 'auto'")
    if header_request_id is not None:
        check_request_id("x-request-id", header_request_id, limits)
    # the intake's and the grammar checks' names of fields, as this API spells them
    names = {
        "max_tokens": "max_output_tokens",
        "logprobs": "top_logprobs",
        "messages": "input",
        "prompt": "input",
        "response_format": "text.format",
        "response_format.json_schema.schema": "text.format.schema",
    }
    for i in range(len(tool_spec.tools) if tool_spec is not None else 0):
        names[f"tools[{i}].function.parameters"] = f"tools[{i}].parameters"
    spec = make_spec(
        # the server's own id, never a client's: it keys the kept response (a client's
        # X-Request-Id comes back as sent, in the answer's header)
        request_id="resp_" + uuid.uuid4().hex,
        tenant=tenant,
        claimed_tenant=tenant or "",
        messages=msgs,
        chat=tools.chat_options(
            ChatOptions(template_kwargs={"reasoning_effort": effort} if effort else {}),
            tool_spec,
            msgs,
        ),
        grammars=tool_spec.schemas if tool_spec is not None else (),
        values=values,
        # truncation "auto": a conversation that outgrows the context loses its oldest turns
        drop_turns=truncation == "auto",
        fill_context=True,  # no max_output_tokens: as long as the context allows
        limits=limits,
        names=names,
    )
    echoed = {
        "instructions": body.get("instructions"),
        "max_output_tokens": max_out,
        "metadata": metadata or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": spec.params.temperature,
        "top_p": spec.params.top_p,
        "text": {"format": body["text"]["format"]} if text_format is not None else _PLAIN,
        "tool_choice": body.get("tool_choice", "auto" if tool_spec else "none"),
        "tools": body.get("tools") or [],
        "truncation": truncation,
        "top_logprobs": top,
        "user": body.get("user"),
        "store": store,
        "previous_response_id": previous,
        "reasoning": {"effort": effort, "summary": None} if effort else None,
    }
    meta = ResponsesRequest(
        model=model or "",
        stream=stream,
        response_id=spec.request_id,
        created=now,
        tools=tool_spec,
        top_logprobs=spec.params.logprobs,
        echoed=echoed,
        store=store,
        previous_response_id=previous,
        conversation=conversation,
    )
    return meta, spec


_PLAIN = {"format": {"type": "text"}}
LOGPROBS = "message.output_text.logprobs"  # the include that asks for them


def _text(field: str, content: Any) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise F.bad_type(field, content, "a string or a list of input_text parts")
    parts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in _TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidRequest(
                f"{field}[{j}]",
                F.shown(kind) if kind else "<part>",
                "must be an {type: 'input_text', text: str} part (text only)",
            )
        parts.append(part["text"])
    return "".join(parts)


def _reasoning(item: dict[str, Any], name: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts (this server's answers carry
    them), else its ``summary_text`` parts."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise F.bad_type(f"{name}.{key}", parts, f"a list of {kind} parts")
        texts = []
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise F.bad_type(f"{name}.{key}[{j}]", part, f"a {{type: '{kind}', text}} part")
            texts.append(part["text"])
        if texts:
            return "".join(texts)
    return ""


def _instructions(body: dict[str, Any]) -> list[dict[str, Any]]:
    instructions = body.get("instructions")
    if instructions is None:
        return []
    return [{"role": "system", "content": _text("instructions", instructions)}]


def _input(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls form one assistant turn's
    ``tool_calls``, each output a tool turn."""
    if isinstance(items, str):
        if not items:
            raise InvalidRequest("input", "", "must be a non-empty string or list of items")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise F.bad_type("input", items, "a non-empty string or list of items")
    out: list[dict[str, Any]] = []
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        name = f"input[{i}]"
        if not isinstance(item, dict):
            raise F.bad_type(name, item, "an input item object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequest(f"{name}.role", F.shown(role), f"must be one of {_ROLES}")
            out.append({"role": role, "content": _text(f"{name}.content", item.get("content"))})
        elif kind == "function_call":
            call = _call(item, name)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise F.bad_type(f"{name}.call_id", call_id, "the call's call_id")
            output = _text(f"{name}.output", item.get("output"))
            out.append({"role": "tool", "content": output, "tool_call_id": call_id})
        elif kind == "reasoning":
            thought = _reasoning(item, name)
            continue
        else:
            raise InvalidRequest(
                f"{name}.type",
                F.shown(kind),
                "must be message, function_call, function_call_output or reasoning",
            )
        # an earlier turn's reasoning goes with its answer, for the template (Qwen3's shows
        # the reasoning of the turns after the last user message: a tool-calling loop's)
        if thought and out[-1]["role"] == "assistant":
            out[-1].setdefault("reasoning_content", thought)
        thought = ""
    if not any(m["role"] not in ("system", "developer") for m in out):
        raise InvalidRequest("input", "<no message>", "must hold at least one input message")
    return out


def _effort(body: dict[str, Any]) -> str | None:
    """``reasoning.effort``, for the chat template (gpt-oss's reads it)."""
    reasoning = F.get_typed(body, "reasoning", lambda v: isinstance(v, dict), "an object")
    effort = (reasoning or {}).get("effort")
    if effort is not None and effort not in F.REASONING_EFFORTS:
        raise InvalidRequest(
            "reasoning.effort",
            F.shown(effort),
            f"must be one of {', '.join(F.REASONING_EFFORTS)}",
        )
    return effort


def _call(item: dict[str, Any], name: str) -> dict[str, Any]:
    fn, args, call_id = item.get("name"), item.get("arguments", ""), item.get("call_id")
    for field, value in (("name", fn), ("arguments", args), ("call_id", call_id)):
        if not isinstance(value, str):
            raise F.bad_type(f"{name}.{field}", value, "a string")
    return {"id": call_id, "type": "function", "function": {"name": fn, "arguments": args}}


# a chat field's name -> the Responses API's, for errors raised by the chat helpers
_CHAT_NAMES = (
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^response_format\.json_schema\."), "text.format."),
    (re.compile(r"^response_format"), "text.format"),
)


def _responses_name(exc: InvalidRequest) -> InvalidRequest:
    field = exc.field
    for pattern, repl in _CHAT_NAMES:
        field = pattern.sub(repl, field)
    return renamed(exc, {exc.field: field}) if field != exc.field else exc


def _tools(body: dict[str, Any], constraint: Any) -> tools.ToolSpec | None:
    """Flat function tools ({type, name, description, parameters}) as the chat's, and the
    tool choice ({type: function, name} for a named one)."""
    given, choice = body.get("tools"), body.get("tool_choice")
    chat_tools = given
    if isinstance(given, list):
        chat_tools = []
        for i, t in enumerate(given):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise InvalidRequest(
                    f"tools[{i}].type", F.shown(kind), "must be 'function' (function tools only)"
                )
            fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
            chat_tools.append({"type": "function", "function": fn})
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat = {"tools": chat_tools, "tool_choice": choice}
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    try:
        return tools.tools_from_body(chat, constraint)
    except InvalidRequest as exc:
        raise _responses_name(exc) from None


def _text_format(text: Any) -> Any:
    """``text.format``: text, json_object, or json_schema ({name, schema, strict})."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise F.bad_type("text", text, "an object with format")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise F.bad_type("text.format", fmt, "an object with type")
    rf: dict[str, Any] = {"type": fmt.get("type")}
    if fmt.get("type") == "json_schema":
        rf["json_schema"] = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    try:
        return structured_fields.structured_from_body({"response_format": rf})
    except InvalidRequest as exc:
        raise _responses_name(exc) from None
