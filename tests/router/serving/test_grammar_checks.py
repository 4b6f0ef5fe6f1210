"""A request's grammars (its output constraint, a chat's tool schemas) are compile-checked by
the intake in a thread of its own, never on the router's event loop: a hostile schema that
fits a small body takes the library up to a second, and the loop serves every client of the
router, gRPC included. Both edges' requests go through the same check."""

from __future__ import annotations

import asyncio
import threading

import pytest

import kvstore.requests.output_constraint as structured_mod
from kvstore.requests.errors import InvalidRequest
from protos.kvcluster.v1 import kvcluster_pb2 as pb
from router.edge.convert import spec_from_pb
from router.http_api.openai_request import parse_request
from router.placement.config import RequestLimits
from router.serving.edge_intake import Intake
from tests.router.http_api.test_http_hostile_bodies import Core, Tokenizer

LIMITS = RequestLimits()
ASK = [{"role": "user", "content": "hi"}]


class ChatTokenizer(Tokenizer):
    def encode_chat(self, messages: list, **options: object) -> list[int]:
        return [1] * len(messages)


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def http_spec(body: dict, chat: bool = True):  # noqa: ANN201
    key = {"messages": ASK} if chat else {"prompt": "hi"}
    _, (spec,) = parse_request(
        {"model": "m", **key, **body}, chat=chat, tenant=None, limits=LIMITS, now=0
    )
    return spec


def test_grammars_compile_in_the_intakes_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    compile_check = structured_mod._check.__wrapped__  # past the cache: every call is seen

    def spy(grammar: str) -> str:
        threads.append(threading.current_thread())
        return compile_check(grammar)

    monkeypatch.setattr(structured_mod, "_check", spy)
    intake = Intake(Core(), ChatTokenizer(), auth=None, limits=LIMITS)  # type: ignore[arg-type]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grpc_req = pb.GenerateRequest(text="hi")
    grpc_req.params.structured.regex = "[a-z"
    cases = [  # (spec, the field its error names; None: it compiles)
        (http_spec({"guided_regex": "[a-z]+"}, chat=False), None),
        (http_spec({"guided_regex": "(unclosed"}, chat=False), "guided_regex"),
        (
            http_spec({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
            None,
        ),
        # auto: no output grammar, yet every tool's schema is checked (the second is bad)
        (
            http_spec({"tools": [tool("f", schema), tool("g", {"type": "florp"})]}),
            "tools[1].function.parameters",
        ),
        (http_spec({"tools": [tool("f", schema)], "tool_choice": "required"}), None),
        (spec_from_pb(grpc_req), "params.structured.regex"),
    ]

    async def main() -> threading.Thread:
        for spec, field in cases:
            if field is None:
                assert await intake.token_ids(spec)
                continue
            with pytest.raises(InvalidRequest) as err:
                await intake.token_ids(spec)
            assert err.value.field == field, err.value
        return threading.current_thread()

    try:
        loop_thread = asyncio.run(main())
    finally:
        intake.close()
    # one check per grammar: 1 + 1 + 1, both tools (2), required's own and its tool's (2), 1
    assert len(threads) == 8
    assert all(t is not loop_thread and t.name.startswith("grammar-check") for t in threads)


def test_parsers_leave_the_compile_to_the_intake() -> None:
    """Parsing builds the constraints (their JSON checked) without compiling them."""
    spec = http_spec({"guided_grammar": "start: undefined_rule"})
    assert [g.field for g in spec.grammars] == ["guided_grammar"]
    assert spec.params.structured is spec.grammars[0]
    assert http_spec({}).grammars == ()
