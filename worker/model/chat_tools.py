"""Tools in a chat, for templates that take them and for templates that do not.

Templates of Qwen2.5/3, Llama 3.x and SmolLM2's newer releases read ``tools`` and render
assistant ``tool_calls`` and ``tool`` turns themselves; they get the conversation as it is
(each call's ``arguments`` JSON text as a mapping, which those templates expect). A template
that never mentions ``tools`` (SmolLM2-135M-Instruct's GGUF has a plain ChatML one) would
drop them silently, so the tools go into the system turn as a Hermes-style prompt
(``<tools>`` JSON, answer with ``<tool_call>{...}</tool_call>``), earlier calls become that
text in their assistant turn, and tool results become ``<tool_response>`` user turns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.requests import json_text
from kvstore.requests.errors import InvalidRequest

_PROMPT = (
    "You may call functions to answer. They are listed within <tools></tools>:\n<tools>\n"
    "{tools}\n</tools>\nTo call one, answer with its name and arguments as JSON within "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json_text.loads(args, "arguments") if args.strip() else {}
        except InvalidRequest:
            pass  # not JSON, or nested too deep to walk: the template shows it as it came
    return {**call, "function": fn}


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def with_tools(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template: str | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as ``template`` should see them."""
    msgs = [
        {**m, "tool_calls": [_arguments(c) for c in m["tool_calls"]]}
        if m.get("tool_calls")
        else dict(m)
        for m in messages
    ]
    if takes_tools(template):
        return msgs, list(tools) if tools else None
    out: list[dict[str, Any]] = []
    for m in msgs:
        if m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + _compact(
                    {"name": c["function"].get("name"), "arguments": c["function"].get("arguments")}
                )
                + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            text = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = _PROMPT.format(tools="\n".join(_compact(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None
