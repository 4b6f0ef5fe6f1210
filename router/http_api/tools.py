"""Tool calling over the OpenAI chat API: ``tools``, ``tool_choice``, tool calls in the answer.

* The tools go to the model's chat template (``tools=``; a template that does not take them
  gets them as a Hermes-style system prompt, ``worker/model/chat_tools.py``); assistant
  ``tool_calls`` and ``role: tool`` results in the history are rendered too.
* ``tool_choice``: ``none`` (tools rendered, no call parsed), ``auto`` (the model decides;
  its output is parsed for calls), ``required`` and a named function: enforced by a grammar
  built from the tools' parameter schemas, so the call always parses. ``required`` makes
  the output a JSON array of ``{"name", "arguments"}`` (one item if
  ``parallel_tool_calls`` is false); a named function makes it that function's arguments.
* Parsing and streaming the answer's calls live in ``tool_calls.py``. Parsing
  (:func:`parse_calls`): the Hermes ``<tool_call>{...}</tool_call>`` blocks of
  SmolLM2 / Qwen2.5 / Qwen3, and Llama 3's JSON (``{"name", "parameters"}``, optionally
  after ``<|python_tag|>``, several separated by ``;``). Only names among the tools count.
* Streaming (:class:`ToolStream`): text that may be a call is held back; a call goes out as
  one ``tool_calls`` delta per call when its choice ends (``finish_reason: tool_calls``),
  which the ``openai`` client assembles like any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.output_constraint import StructuredOutputs

FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
MAX_TOOLS = 128


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """What a request's tools mean for its answer."""

    tools: tuple[dict[str, Any], ...]  # OpenAI tool objects, as sent
    choice: str  # "none", "auto", "required" or "function"
    function: str | None = None  # the named function (choice "function")
    constraint: StructuredOutputs | None = None  # the grammar required / named enforce
    names: frozenset[str] = field(default=frozenset())
    # every tool's parameters schema, for the intake's compile check (off the event loop)
    schemas: tuple[StructuredOutputs, ...] = ()

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def _check_tools(tools: Any) -> tuple[StructuredOutputs, ...]:
    """The tools' parameter schemas (checked as JSON schemas; compiled by the intake)."""
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("tools", "<" + type(tools).__name__ + ">", "must be a non-empty list")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest("tools", f"<{len(tools)} tools>", f"must hold at most {MAX_TOOLS}")
    seen: set[str] = set()
    schemas = []
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
        schemas.append(StructuredOutputs.json_schema(params, f"{f}.function.parameters"))
    return tuple(schemas)


def _params(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def tools_from_body(body: dict[str, Any], constraint: StructuredOutputs | None) -> ToolSpec | None:
    """The body's tools and tool_choice (None when it has no tools); raises InvalidRequest
    naming the field for an unknown tool name or a schema that is not one (the intake
    compile-checks :attr:`ToolSpec.schemas` and :attr:`ToolSpec.constraint`)."""
    choice = body.get("tool_choice")
    if body.get("tools") is None:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice", "<set>", "needs tools")
        return None
    schemas = _check_tools(body["tools"])
    tools = tuple(body["tools"])
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
    return ToolSpec(tools, choice, function, spec, names, schemas)


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


def chat_options(options: Any, spec: ToolSpec | None, messages: list[dict[str, Any]]) -> Any:
    """A request's ``ChatOptions`` with its tools for the template, and the size of what
    the template writes besides the contents (the tools, the history's calls, their ids and
    the authors' names), which counts against the prompt's character cap before anything
    is rendered."""
    calls = [m["tool_calls"] for m in messages if "tool_calls" in m]
    ids = sum(len(m.get("tool_call_id", "")) + len(m.get("name", "")) for m in messages)
    rendered = (len(json.dumps(calls)) if calls else 0) + ids
    if spec is not None:
        options = replace(options, tools=spec.tools)
        rendered += len(json.dumps(spec.tools))
    return replace(options, rendered_chars=rendered)
