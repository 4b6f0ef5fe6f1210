"""Every typed error with its own ``__init__`` survives pickling (Ray moves errors between
processes) with its type, message, args and fields intact, notes included; a new one must
join the list (the completeness test finds them all in the product packages)."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path

import pytest

from cluster.client_errors import ClientCancelled
from kvstore.requests.errors import EngineOverloaded, InvalidRequest, WireMismatch
from router.edge.interceptors import Malformed
from router.serving.request_errors import ResponseNotFound
from worker.engine.executor import KVTransferUnsupported
from worker.kv.disk_format import CorruptRunFile
from worker.kv.transfer import ImportRefused
from worker.pull.transport import PullFailed

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "worker", "router", "cluster")

CASES = [
    InvalidRequest("top_p", 1.5, "must be in (0, 1]", "use 1.0 to turn it off"),
    InvalidRequest("prompt", 70_000, "longer than max_model_len=4096"),
    EngineOverloaded(17, 16),
    WireMismatch("OutputBatch field 'logprobs' has an unknown layout"),
    PullFailed("timeout", "the source sent nothing for 2.0 s"),
    KVTransferUnsupported("TinyExecutor"),
    ImportRefused("block 3's token ids differ from the prompt's"),
    Malformed("prompt: a string field that is not UTF-8"),
    CorruptRunFile("block 2 fails its checksum"),
    ClientCancelled("the call was still open 2.0 s past its deadline"),
    ResponseNotFound("resp_0123", "previous_response_id"),
]


@pytest.mark.parametrize("error", CASES, ids=lambda e: type(e).__name__)
def test_a_typed_error_round_trips_through_pickle(error: BaseException) -> None:
    error.add_note("raised while serving request r-1")
    error.request_id = "r-1"  # type: ignore[attr-defined]  # set after raising, as callers may
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)  # every field, the note and the late attribute too


def _classes_with_init() -> list[tuple[str, str]]:
    """(module, class) of every class in the product packages that defines ``__init__``."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(
                ".__init__"
            )
            for node in ast.parse(path.read_text()).body:
                if (
                    isinstance(node, ast.ClassDef)
                    and node.bases
                    and any(
                        isinstance(m, ast.FunctionDef) and m.name == "__init__" for m in node.body
                    )
                ):
                    found.append((module, node.name))
    return found


def test_every_typed_error_with_its_own_init_is_covered() -> None:
    errors = set()
    for module, name in _classes_with_init():
        cls = getattr(importlib.import_module(module), name)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            errors.add(cls)
    assert errors == {type(e) for e in CASES}
