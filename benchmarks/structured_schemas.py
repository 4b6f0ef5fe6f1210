"""The structured-output benchmark's workload: 60 JSON schemas and 50 tool-calling requests.

Schemas cover objects, arrays, enums, nesting, numbers and integers with bounds, nullable
fields, ``anyOf``, ``const`` and string formats; strings are bounded as a strict schema of a
real API bounds them (a free-text field of a 135M model may otherwise run to max_tokens).
Built from a fixed seed, so every run sends the same set.
"""

from __future__ import annotations

import json
import random
from typing import Any

_WORDS = ["city", "name", "title", "label", "code", "owner", "color", "model", "topic", "note"]


def _prop(rng: random.Random, depth: int) -> dict[str, Any]:
    kind = rng.choice(
        ["str", "int", "num", "bool", "enum", "arr_int", "arr_enum", "null_str", "date", "obj"]
        if depth < 2
        else ["str", "int", "num", "bool", "enum"]
    )
    if kind == "str":
        return {"type": "string", "minLength": 1, "maxLength": rng.choice([8, 16, 24])}
    if kind == "int":
        lo = rng.randint(-50, 10)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(5, 500)}
    if kind == "num":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 1e4])}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], 3)}
    if kind == "arr_int":
        return {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 1,
            "maxItems": rng.randint(2, 5),
        }
    if kind == "arr_enum":
        return {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
    if kind == "null_str":
        return {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]}
    if kind == "date":
        return {"type": "string", "format": "date"}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {n: _prop(rng, depth) for n in names},
        "required": names,
        "additionalProperties": False,
    }


def schemas(count: int = 60, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` distinct schemas: mostly objects, some top-level arrays, enums, constants."""
    rng = random.Random(seed)
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while len(out) < count:
        shape = i % 6
        if shape == 4:
            schema = {"type": "array", "items": _object(rng, 1), "minItems": 1, "maxItems": 3}
        elif shape == 5 and i % 12 == 5:
            schema = {"enum": ["alpha", "beta", i, None]}
        elif shape == 5:
            schema = _object(rng, 1)
            schema["properties"]["kind"] = {"const": "record"}
            schema["required"].append("kind")
        else:
            schema = _object(rng, 0)
        out.setdefault(json.dumps(schema, sort_keys=True), schema)
        i += 1
    return list(out.values())


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": props,
                "required": list(props),
                "additionalProperties": False,
            },
        },
    }
    for name, desc, props in [
        (
            "get_weather",
            "Current weather of a city",
            {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
        ),
        (
            "get_time",
            "Time in a UTC offset",
            {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
        ),
        (
            "search",
            "Search the web",
            {
                "query": {"type": "string", "maxLength": 40},
                "limit": {"type": "integer", "minimum": 1, "maximum": 10},
            },
        ),
        (
            "convert",
            "Convert an amount of money",
            {
                "amount": {"type": "number", "minimum": 0},
                "to": {"enum": ["usd", "eur", "gbp", "jpy"]},
            },
        ),
        (
            "add_event",
            "Add a calendar event",
            {
                "title": {"type": "string", "maxLength": 30},
                "date": {"type": "string", "format": "date"},
            },
        ),
        (
            "send_mail",
            "Send an e-mail",
            {
                "to": {"type": "string", "maxLength": 30},
                "body": {"type": "string", "maxLength": 60},
            },
        ),
    ]
]
QUESTIONS = [
    "What is the weather in Paris?",
    "What time is it in Tokyo?",
    "Find recent news about Mars rovers.",
    "How many euros are 50 dollars?",
    "Put a dentist appointment on my calendar for 2025-03-02.",
    "Tell Bob the meeting moved to noon.",
    "Is it raining in Oslo right now?",
    "Search for a pancake recipe.",
]


def tool_requests(count: int = 50, seed: int = 0) -> list[tuple[str, list[dict[str, Any]]]]:
    """``count`` (question, tools) pairs, 2-4 tools each."""
    rng = random.Random(seed)
    return [(rng.choice(QUESTIONS), rng.sample(TOOLS, rng.randint(2, 4))) for _ in range(count)]
