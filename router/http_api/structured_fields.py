"""OpenAI's and vLLM's structured-output fields -> the API's ``SamplingParams.structured``.

Accepted spellings (at most one constraint per request):

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (OpenAI; what ``client.chat.completions.parse`` sends for a pydantic model);
* ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object"}``
  (vLLM);
* ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (vLLM's older
  fields).

Each constraint names the field as the client spelled it
(``response_format.json_schema.schema``), so a schema the grammar library cannot compile
(the intake checks it, off the event loop) is a 400 naming that field.
"""

from __future__ import annotations

from typing import Any

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.output_constraint import StructuredOutputs
from kvstore.requests.sampling_params import WIRE

FIELDS = WIRE["structured"].openai  # (SamplingParams' declaration)
GUIDED = tuple(name for name in FIELDS if name.startswith("guided_"))
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _text(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(field, type(value).__name__, "must be a string")
    return value


def _response_format(rf: Any) -> StructuredOutputs | None:
    if not isinstance(rf, dict):
        raise InvalidRequest("response_format", type(rf).__name__, "must be an object")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json_object", "", "response_format")
    if kind != "json_schema":
        raise InvalidRequest(
            "response_format.type", kind, "must be one of text, json_object, json_schema"
        )
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            "response_format.json_schema", type(spec).__name__, "must be an object with schema"
        )
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise InvalidRequest(
            "response_format.json_schema",
            sorted(unknown)[0],
            "unknown field (known: name, schema, strict, description)",
        )
    if "schema" not in spec:
        raise InvalidRequest("response_format.json_schema.schema", None, "is required")
    schema = spec["schema"]
    if spec.get("strict") is True:
        schema = strict_schema(schema)
    return StructuredOutputs.json_schema(schema, "response_format.json_schema.schema")


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: an object takes no properties but its own unless its schema says
    otherwise (``additionalProperties: false`` wherever it is unset), in nested schemas too."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if "properties" in out and isinstance(out["properties"], dict):
        out["properties"] = {k: strict_schema(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def _vllm(so: Any) -> StructuredOutputs | None:
    if not isinstance(so, dict):
        raise InvalidRequest("structured_outputs", type(so).__name__, "must be an object")
    given = {k: v for k, v in so.items() if v not in (None, False)}
    unknown = set(given) - {*_VLLM_KINDS, "json_object"}
    if unknown:
        raise InvalidRequest(
            "structured_outputs",
            sorted(unknown)[0],
            "unknown field (known: json, regex, choice, grammar, json_object)",
        )
    if len(given) > 1:
        raise InvalidRequest("structured_outputs", sorted(given), "set exactly one constraint")
    if not given:
        return None
    ((key, value),) = given.items()
    field = f"structured_outputs.{key}"
    return _build(_VLLM_KINDS.get(key, "json_object"), value, field)


def _build(kind: str, value: Any, field: str) -> StructuredOutputs:
    if kind == "json_schema":
        return StructuredOutputs.json_schema(value, field)
    if kind == "choice":
        return StructuredOutputs.choice(value, field)
    if kind == "json_object":
        return StructuredOutputs("json_object", "", field)
    return StructuredOutputs(kind, _text(field, value), field)  # type: ignore[arg-type]


def structured_from_body(body: dict[str, Any]) -> StructuredOutputs | None:
    """The one constraint the body asks for (None: free text); raises InvalidRequest naming
    the field. Its compile check is the intake's (``Intake.token_ids``)."""
    found: list[StructuredOutputs] = []
    named = [k for k in FIELDS if body.get(k)]
    if len(named) > 1:
        raise InvalidRequest(named[1], "<set>", f"cannot be combined with {named[0]}")
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        found += [spec] if spec else []
    if body.get("structured_outputs") is not None:
        spec = _vllm(body["structured_outputs"])
        found += [spec] if spec else []
    for name in GUIDED:
        if body.get(name) is not None:
            kind = {"guided_json": "json_schema", "guided_choice": "choice"}.get(
                name, name.removeprefix("guided_")
            )
            found.append(_build(kind, body[name], name))
    if not found:
        return None
    return found[0]
