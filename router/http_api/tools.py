"""Tool calling over the OpenAI chat API: ``tools``, ``tool_choice``, tool calls in the answer.

* The tools go to the model's chat template (``tools=``; a template that does not take them
  gets them as a Hermes-style system prompt, ``worker/model/chat_tools.py``); assistant
  ``tool_calls`` and ``role: tool`` results in the history are rendered too.
* ``tool_choice``: ``none`` (tools rendered, no call parsed), ``auto`` (the model decides;
  its output is parsed for calls), ``required`` and a named function: enforced by a grammar
  built from the tools' parameter schemas, so the call always parses. ``required`` makes
  the output a JSON array of ``{"name", "arguments"}`` (one item if
  ``parallel_tool_calls`` is false); a named function makes it that function's arguments.
* Parsing (:func:`parse_calls`): the Hermes ``<tool_call>{...}</tool_call>`` blocks of
  SmolLM2 / Qwen2.5 / Qwen3, and Llama 3's JSON (``{"name", "parameters"}``, optionally
  after ``<|python_tag|>``, several separated by ``;``). Only names among the tools count.
* Streaming (:class:`ToolStream`): text that may be a call is held back; a call goes out as
  one ``tool_calls`` delta per call when its choice ends (``finish_reason: tool_calls``),
  which the ``openai`` client assembles like any other.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.blocks.errors import InvalidRequest
from kvstore.blocks.structured import StructuredOutputs

FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
MAX_TOOLS = 128
_MARKERS = ("<tool_call>", "<|python_tag|>")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """What a request's tools mean for its answer."""

    tools: tuple[dict[str, Any], ...]  # OpenAI tool objects, as sent
    choice: str  # "none", "auto", "required" or "function"
    function: str | None = None  # the named function (choice "function")
    constraint: StructuredOutputs | None = None  # the grammar required / named enforce
    names: frozenset[str] = field(default=frozenset())

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def _check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("tools", "<" + type(tools).__name__ + ">", "must be a non-empty list")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest("tools", f"<{len(tools)} tools>", f"must hold at most {MAX_TOOLS}")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        f = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise InvalidRequest(f"{f}.type", "<tool>", "must be 'function'")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"{f}.function.name", None, "is required (a non-empty string)")
        if fn["name"] in seen:
            raise InvalidRequest(f"{f}.function.name", fn["name"], "must be unique")
        seen.add(fn["name"])
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise InvalidRequest(f"{f}.function.parameters", "<value>", "must be a JSON schema")
        StructuredOutputs.json_schema(params, f"{f}.function.parameters").check()
    return tuple(tools)


def _params(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def tools_from_body(body: dict[str, Any], constraint: StructuredOutputs | None) -> ToolSpec | None:
    """The body's tools and tool_choice (None when it has no tools); raises InvalidRequest
    naming the field for an unknown tool name or a schema the library cannot compile."""
    choice = body.get("tool_choice")
    if body.get("tools") is None:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice", "<set>", "needs tools")
        return None
    tools = _check_tools(body["tools"])
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls", parallel, "must be true or false")
    names = frozenset(t["function"]["name"] for t in tools)
    choice = "auto" if choice is None else choice
    function = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        function = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(function, str):
            raise InvalidRequest(
                "tool_choice", "<object>", "must be {type: 'function', function: {name}}"
            )
        if function not in names:
            raise InvalidRequest(
                "tool_choice.function.name", function, f"is not a tool; tools: {sorted(names)}"
            )
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequest("tool_choice", choice, "must be none, auto, required or a function")
    spec = None
    if choice in ("required", "function") and constraint is not None:
        raise InvalidRequest(
            "tool_choice", choice, "cannot be combined with response_format / structured_outputs"
        )
    if choice == "function":
        tool = next(t for t in tools if t["function"]["name"] == function)
        spec = StructuredOutputs.json_schema(_params(tool), "tool_choice")
    elif choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "arguments": _params(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        spec = StructuredOutputs.json_schema(schema, "tools")
    if spec is not None:
        spec.check()
    return ToolSpec(tools, choice, function, spec, names)


# ---- the answer --------------------------------------------------------------------------


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


def _as_call(obj: Any, names: frozenset[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict | str):
        return None
    return _call(obj["name"], args)


def _json_calls(text: str, names: frozenset[str]) -> list[dict[str, Any]] | None:
    """Llama 3's JSON calls: one object, a list, or objects separated by ';'."""
    dec = json.JSONDecoder()
    text = text.strip().removeprefix("<|python_tag|>").strip()
    objs: list[Any] = []
    pos = 0
    while pos < len(text):
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        objs += obj if isinstance(obj, list) else [obj]
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    calls = [_as_call(o, names) for o in objs]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def parse_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a finished answer."""
    if not spec.parses:
        return text, []
    if spec.choice == "function":
        assert spec.function is not None
        return None, [_call(spec.function, text)]
    if spec.choice == "required":
        calls = _json_calls(text, spec.names)
        return (None, calls) if calls else (text, [])
    if "<tool_call>" in text:
        head, _, rest = text.partition("<tool_call>")
        calls = []
        for block in ("<tool_call>" + rest).split("<tool_call>")[1:]:
            body = block.split("</tool_call>")[0].strip()
            try:
                call = _as_call(json.loads(body), spec.names)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return (head.strip() or None), calls
    calls = _json_calls(text, spec.names) if text.lstrip()[:1] in "{[<" and text.strip() else None
    return (None, calls) if calls else (text, [])


def message_json(text: str, spec: ToolSpec | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole answer, and the finish reason tool calls force."""
    if spec is None:
        return {"role": "assistant", "content": text}, None
    content, calls = parse_calls(text, spec)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
        return msg, "tool_calls"
    return msg, None


class ToolStream:
    """One streamed choice of a request with tools: text that may be a call is held back
    until the answer ends; plain text flows as content deltas."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.held = ""  # text not sent yet (a call, or what may start one)
        self.sent = ""  # content already sent
        self.calling = spec.choice in ("required", "function")  # the whole answer is a call

    def feed(self, text: str) -> str:
        """New text -> the content that may go out now."""
        if not self.spec.parses:
            return text
        self.held += text
        if self.calling:
            return ""
        body = self.held.lstrip()
        if not self.sent and body[:1] in ("{", "["):
            self.calling = True  # Llama-style JSON call (or JSON text: sent at the end)
            return ""
        for m in _MARKERS:
            at = self.held.find(m)
            if at >= 0:
                out, self.held, self.calling = self.held[:at], self.held[at:], True
                self.sent += out
                return out
        # hold back a tail that may begin a marker
        cut = len(self.held)
        for m in _MARKERS:
            for k in range(min(len(m) - 1, len(self.held)), 0, -1):
                if self.held.endswith(m[:k]):
                    cut = min(cut, len(self.held) - k)
                    break
        if not self.sent and not body:
            cut = 0  # only whitespace so far: a call may follow
        out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The answer ended: (content still to send, tool calls)."""
        held, self.held = self.held, ""
        if not self.spec.parses:
            return held, []
        content, calls = parse_calls(self.sent + held, self.spec)
        if not calls:
            return held, []
        rest = (content or "")[len(self.sent) :] if content else ""
        return rest, calls


# ---- the history -------------------------------------------------------------------------


def tool_fields(m: dict[str, Any], field: str) -> dict[str, Any]:
    """A chat message's tool fields, checked: an assistant turn's ``tool_calls`` and a tool
    turn's ``tool_call_id`` (what the chat template renders)."""
    out: dict[str, Any] = {}
    calls, call_id = m.get("tool_calls"), m.get("tool_call_id")
    if calls is not None:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise InvalidRequest(
                f"{field}.tool_calls", "<value>", "must be a list, on an assistant message"
            )
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequest(
                    f"{field}.tool_calls[{j}].function", "<value>", "must have a name"
                )
            if not isinstance(fn.get("arguments", ""), str):
                raise InvalidRequest(
                    f"{field}.tool_calls[{j}].function.arguments", "<value>", "must be a string"
                )
        if calls:
            out["tool_calls"] = calls
    if call_id is not None:
        if not isinstance(call_id, str):
            raise InvalidRequest(f"{field}.tool_call_id", "<value>", "must be a string")
        out["tool_call_id"] = call_id
    return out


def chat_options(options: Any, spec: ToolSpec | None) -> Any:
    """A request's ``ChatOptions`` with its tools for the template."""
    return replace(options, tools=spec.tools) if spec is not None else options


def tool_chunk_delta(
    stream: ToolStream, text: str, reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """One stream chunk's ``delta`` and finish reason for a choice with tools."""
    delta: dict[str, Any] = {"content": stream.feed(text)}
    if reason is None:
        return delta, None
    rest, calls = stream.finish()
    delta["content"] = delta["content"] + rest
    if not calls:
        return delta, reason
    delta["tool_calls"] = [
        {"index": k, **{key: c[key] for key in ("id", "type", "function")}}
        for k, c in enumerate(calls)
    ]
    if not delta["content"]:
        delta["content"] = None
    return delta, "tool_calls"
