"""Structured outputs: the constraint a request puts on its completion, as a grammar.

A request may ask for JSON that follows a schema (``json_schema``), any JSON object
(``json_object``), text matching a regular expression (``regex``), one of a list of strings
(``choice``), or text of a context-free grammar (``grammar``: Lark, as llguidance reads it,
or GBNF/EBNF with ``::=`` rules, as llama.cpp and xgrammar write them). The engine compiles
it against the model's tokenizer and masks every token the grammar does not allow
(``worker/engine/structured.py``), so the output always parses.

The grammar library is llguidance (picked over xgrammar by measurement on this project's
tokenizers, see README "Structured outputs and tools"): it imports without torch, so the
router checks a grammar (:meth:`StructuredOutputs.check`) without a tokenizer before the
request is routed, and a grammar the library cannot compile is a 400 / INVALID_ARGUMENT
naming the client's field, never an engine error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from dataclasses import field as dc_field
from functools import lru_cache
from typing import Any, Literal

from kvstore.requests import json_text
from kvstore.requests.errors import InvalidRequest
from kvstore.requests.wire import ByName

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema / regex / grammar text (each choice counts too)
MAX_CHOICES = 1024
# Nested lists / objects of a schema: above an HTTP body's own bound (a tool's parameters
# sit inside the schema tool_choice=required wraps around them), far below the depth at
# which parsing or compiling it would recurse out of the stack.
MAX_SCHEMA_DEPTH = 2 * json_text.MAX_DEPTH
# The compiled grammar's size (symbols in its productions): far above any real schema, low
# enough that one request's compile cannot take the worker's compile thread for long.
MAX_GRAMMAR_SYMBOLS = 200_000
# JSON: no free whitespace between tokens (a small model would otherwise pad with spaces or
# newlines until max_tokens); strings still hold any whitespace.
JSON_OPTIONS = {"whitespace_flexible": False}
# JSON numbers are written with at most 6 decimals and, where the schema sets no tighter
# bound, within +-(2**53 - 1) (what a double holds exactly, RFC 8259's interoperable range):
# a small model otherwise writes digits until max_tokens. Every such number is valid
# against the schema as sent (the bounds are added to the grammar, never to the check).
NUMBER_STEP = 1e-6
NUMBER_LIMIT = 2**53 - 1


def _shown(value: str) -> str:
    return value if len(value) <= 64 else f"<{len(value)} chars>"


@dataclass(frozen=True, slots=True)
class StructuredOutputs(ByName):
    """One constraint; immutable, validated on construction, hashable (the compile cache's
    key is ``(kind, value)``)."""

    kind: Kind
    # json_schema: the schema as compact JSON text (key order kept: it orders the output);
    # regex and grammar: their text; choice: a JSON list of the strings; json_object: "".
    value: str = ""
    # how the client's API names the field (errors quote it); not part of the key
    field: str = dc_field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(self.field, self.kind, f"kind must be one of {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise InvalidRequest(self.field, type(self.value).__name__, "must be text")
        if len(self.value) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(
                self.field,
                f"<{len(self.value)} chars>",
                f"must be at most {MAX_GRAMMAR_CHARS} characters (grammar too large)",
            )
        if self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequest(self.field, "", f"a {self.kind} must not be empty")
        if self.kind == "json_schema":
            schema = json_text.loads(self.value, self.field, max_depth=MAX_SCHEMA_DEPTH)
            if not isinstance(schema, dict | bool):
                raise InvalidRequest(self.field, _shown(self.value), "must be a JSON object")
        if self.kind == "choice":
            choices = json_text.loads(self.value, self.field) if self.value else []
            if (
                not isinstance(choices, list)
                or not 1 <= len(choices) <= MAX_CHOICES
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise InvalidRequest(
                    self.field,
                    _shown(self.value),
                    f"must be 1 to {MAX_CHOICES} non-empty strings",
                )

    # ---- constructors (what the edges call) ----------------------------------------------

    @classmethod
    def json_schema(cls, schema: Any, field: str = "structured_outputs") -> StructuredOutputs:
        """From a schema (a dict, or its JSON text)."""
        if isinstance(schema, str):
            schema = json_text.loads(schema, field, max_depth=MAX_SCHEMA_DEPTH)
        if not isinstance(schema, dict | bool):
            raise InvalidRequest(field, type(schema).__name__, "a JSON schema must be an object")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), field)

    @classmethod
    def choice(cls, options: Any, field: str = "structured_outputs") -> StructuredOutputs:
        if not isinstance(options, list | tuple):
            raise InvalidRequest(field, type(options).__name__, "must be a list of strings")
        if len(options) > MAX_CHOICES:
            raise InvalidRequest(field, f"<{len(options)} choices>", f"at most {MAX_CHOICES}")
        return cls("choice", json.dumps(list(options), ensure_ascii=False), field)

    # ---- the grammar ---------------------------------------------------------------------

    def grammar(self) -> str:
        """The constraint as an llguidance grammar (raises InvalidRequest for a GBNF text
        that does not convert)."""
        return _grammar(self.kind, self.value, self.field)

    def check(self) -> None:
        """Raise InvalidRequest (naming :attr:`field`) if the library cannot compile it; needs
        no tokenizer (results are cached per constraint)."""
        try:
            error = _check(self.grammar())
        except InvalidRequest:
            raise
        except ValueError as exc:  # the JSON compiler's argument check
            error = str(exc)
        if error:
            raise InvalidRequest(self.field, _shown(self.value), f"does not compile: {error}")


def _lark_literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal takes JSON's escapes


@lru_cache(maxsize=512)
def _grammar(kind: Kind, value: str, field: str) -> str:
    from llguidance import LLMatcher  # late: only requests with a constraint pay for it

    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        schema = _bounded_numbers(json.loads(value))
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return "start: " + " | ".join(_lark_literal(c) for c in json.loads(value))
    if "::=" in value:  # GBNF / EBNF rules
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            value = any_to_lark(value)
        except Exception as exc:  # noqa: BLE001 - the converter raises bare exceptions
            raise InvalidRequest(field, _shown(value), f"not a GBNF grammar: {exc}") from None
    return LLMatcher.grammar_from_lark(value)


def _bounded_numbers(node: Any) -> Any:
    """``node`` with every number / integer schema bounded (:data:`NUMBER_LIMIT`) and every
    number stepped (:data:`NUMBER_STEP`) where it does not say otherwise."""
    if isinstance(node, list):
        return [_bounded_numbers(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bounded_numbers(v) for k, v in node.items()}
    kind = out.get("type")  # (in a "properties" map, "type" may name a property)
    kinds = kind if isinstance(kind, list) else [kind]
    types = {t for t in kinds if isinstance(t, str)}
    if types & {"number", "integer"}:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -NUMBER_LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = NUMBER_LIMIT
        if "number" in types and "multipleOf" not in out:
            low = out.get("minimum", out.get("exclusiveMinimum"))
            high = out.get("maximum", out.get("exclusiveMaximum"))
            if _num(low) and _num(high) and high - low >= 1:  # room for the steps
                out["multipleOf"] = NUMBER_STEP
    return out


def _num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parser_limits() -> Any:
    """The llguidance limits every compile runs under (engine and router alike)."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, verbose_errors=False)


@lru_cache(maxsize=512)
def _check(grammar: str) -> str:
    """The library's complaint about ``grammar`` ("" when it compiles)."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar, limits=parser_limits())
