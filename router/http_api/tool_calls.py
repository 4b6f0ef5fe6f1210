"""Tool calls in the answer: parsed from a finished answer, or held back and sent as
``tool_calls`` deltas while it streams (the request side is ``tools.py``)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from router.http_api.tools import ToolSpec

_MARKERS = ("<tool_call>", "<|python_tag|>")


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
