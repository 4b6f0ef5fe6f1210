"""The worker<->router types across a version gap (a rolling upgrade): a peer whose class has
one field fewer or one more is read by name (defaults for what it lacks) or refused with
:class:`WireMismatch` naming the field, never read into the wrong fields.

The peer's class is the real one with a field dropped or inserted (same module and name,
same bases, so it pickles exactly as that version would); the bytes it makes are read with
this version's class. Pure: no Ray, no Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import re
import sys
from typing import Any

import pytest

from kvstore.blocks.tiers import Tier
from kvstore.requests.errors import InvalidRequest, WireMismatch
from kvstore.requests.output_constraint import StructuredOutputs
from kvstore.requests.outputs import (
    OUTPUT_SCHEMA,
    CompletionDelta,
    FinishReason,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from kvstore.requests.protocol import (
    AdapterInfo,
    Admitted,
    CallerRef,
    PullHint,
    PullReport,
    TierFigures,
    WorkerRequest,
    WorkerStatus,
)
from kvstore.requests.sampling_params import SamplingParams
from kvstore.requests.wire import schema_fingerprint
from worker.channels import Channels
from worker.engine.streams import StreamEnd

PARAMS = SamplingParams(
    max_tokens=7,
    min_tokens=2,
    temperature=0.5,
    top_k=5,
    seed=11,
    stop=("end",),
    stop_token_ids=(3, 4),
    logprobs=2,
    priority=-1,
    cache_salt="tenant-a",
    logit_bias=((5, 1.5),),
    structured=StructuredOutputs("regex", "[a-z]+"),
)
HINT = PullHint("worker-1", 2, 3, 0.5, priced_s=0.1)
REPORT = PullReport("worker-1", "ok", 3, 48, 0.02, nbytes=4096, node="n0", source_node="n1")
SAMPLES: list[Any] = [
    PARAMS,
    StructuredOutputs.json_schema({"type": "object"}, field="response_format"),
    WorkerRequest("r1", [1, 2, 3], PARAMS, want_keys=False, pull=HINT),
    HINT,
    REPORT,
    Admitted("worker-1", 4, b"k" * 16, REPORT),
    WorkerStatus(
        "worker-1",
        4,
        1,
        2,
        30,
        64,
        100,
        0.25,
        True,
        tiers={Tier.HOST: TierFigures(8, 3, 48)},
        swap_preemptions=1,
    ),
    AdapterInfo("sql", "sql@abc", True, ("t1",)),
    TierFigures(16, 4, 32, loaded_blocks=2, stored_blocks=6),
    CallerRef("a handle", "inc-1"),
    StreamEnd("r1", RuntimeError("engine stopped")),
]


def peer_class(cls: type, *, drop: str | None = None, insert: tuple | None = None) -> type:
    """``cls`` as a peer of another version defines it: without field ``drop``, or with the
    field ``insert`` = (name, type, dataclasses.field(kw_only=True, ...)) declared second
    (a positional form would shift every later field)."""
    specs = [
        (f.name, f.type, dataclasses.field(default=f.default, init=f.init))
        if f.default is not dataclasses.MISSING
        else (f.name, f.type, dataclasses.field(default_factory=f.default_factory, init=f.init))
        if f.default_factory is not dataclasses.MISSING
        else (f.name, f.type)
        for f in dataclasses.fields(cls)
        if f.name != drop and f.init
    ]
    if insert is not None:
        specs.insert(1, insert)
    peer = dataclasses.make_dataclass(
        cls.__name__, specs, bases=cls.__bases__, frozen=True, slots=True
    )
    peer.__module__, peer.__qualname__ = cls.__module__, cls.__qualname__
    return peer


def sent_by(monkeypatch: pytest.MonkeyPatch, peer: type, obj: Any, **extra: Any) -> bytes:
    """The bytes a peer with class ``peer`` makes of ``obj``'s values (and ``extra``)."""
    names = {f.name for f in dataclasses.fields(peer)}
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    instance = peer(**{k: v for k, v in values.items() if k in names}, **extra)
    with monkeypatch.context() as m:
        m.setattr(sys.modules[peer.__module__], peer.__qualname__, peer)
        return pickle.dumps(instance)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, StreamEnd):  # exceptions compare by identity
        return a.request_id == b.request_id and repr(a.error) == repr(b.error)
    return a == b


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_the_same_version_reads_every_field(obj: Any) -> None:
    assert same(pickle.loads(pickle.dumps(obj)), obj)


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_an_older_peer_without_a_field_is_read_with_its_default(
    obj: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = type(obj)
    for f in dataclasses.fields(cls):
        if not f.init or f.default is dataclasses.MISSING:
            continue
        data = sent_by(monkeypatch, peer_class(cls, drop=f.name), obj)
        try:
            want = dataclasses.replace(obj, **{f.name: f.default})
        except InvalidRequest as exc:  # the default breaks a rule: refused by the rule
            with pytest.raises(InvalidRequest, match=re.escape(exc.limit)):
                pickle.loads(data)
            continue
        assert same(pickle.loads(data), want), f.name


def _required(cls: type) -> list[str]:
    return [
        f.name
        for f in dataclasses.fields(cls)
        if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]


@pytest.mark.parametrize(
    "obj", [o for o in SAMPLES if _required(type(o))], ids=lambda o: type(o).__name__
)
def test_an_older_peer_without_a_required_field_is_refused(
    obj: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = type(obj)
    required = _required(cls)
    data = sent_by(monkeypatch, peer_class(cls, drop=required[-1]), obj)
    with pytest.raises(WireMismatch, match=f"lacks required field.*{required[-1]}"):
        pickle.loads(data)


@pytest.mark.parametrize("obj", SAMPLES, ids=lambda o: type(o).__name__)
def test_a_newer_peer_with_an_unknown_field(obj: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = type(obj)
    peer = peer_class(cls, insert=("new_knob", int, dataclasses.field(default=0, kw_only=True)))
    # left at its default: it is not sent, and everything else is read where it belongs
    assert same(pickle.loads(sent_by(monkeypatch, peer, obj)), obj)
    # set: refused, naming the field (ignoring it would serve the request otherwise)
    data = sent_by(monkeypatch, peer, obj, new_knob=3)
    with pytest.raises(WireMismatch, match="does not know: new_knob=3"):
        pickle.loads(data)


def test_a_peer_is_validated_by_this_side() -> None:
    """Read by name through the constructor: derived fields are rebuilt, rules rechecked."""
    got = pickle.loads(pickle.dumps(PARAMS))
    assert got.stop_token_set == frozenset({3, 4})
    assert pickle.loads(pickle.dumps(SamplingParams())) == SamplingParams()


def test_every_frozen_wire_type_reads_by_name() -> None:
    """A new message type in protocol.py is caught here if it pickles by position."""
    import kvstore.requests.protocol as protocol

    types = {
        obj
        for obj in vars(protocol).values()
        if isinstance(obj, type)
        and dataclasses.is_dataclass(obj)
        and obj.__module__ == protocol.__name__
    }
    assert types == {type(o) for o in SAMPLES if type(o).__module__ == protocol.__name__}
    for t in types | {SamplingParams, StructuredOutputs, StreamEnd}:
        assert t.__reduce__ is not object.__reduce__, t


def test_the_output_schema_names_the_packed_layout() -> None:
    parts = (RequestOutput, CompletionDelta, Usage, TokenLogprob, FinishReason)
    assert schema_fingerprint(*parts) == OUTPUT_SCHEMA
    widened = peer_class(
        Usage, insert=("new_count", int, dataclasses.field(default=0, kw_only=True))
    )
    assert (
        schema_fingerprint(RequestOutput, CompletionDelta, widened, TokenLogprob, FinishReason)
        != OUTPUT_SCHEMA
    )
    narrowed = peer_class(TokenLogprob, drop="top")
    assert schema_fingerprint(*parts[:3], narrowed, FinishReason) != OUTPUT_SCHEMA


@pytest.mark.parametrize("schema", [None, "0123456789abcdef"])
def test_a_channel_of_another_output_layout_is_refused_before_anything_is_sent(
    schema: str | None,
) -> None:
    async def scenario() -> None:
        channels = Channels(lambda rid: None, lambda rid: None)
        with pytest.raises(WireMismatch, match="output channel"):
            async for _ in channels.serve("ch", schema):
                raise AssertionError("a batch was sent")
        assert len(channels) == 0  # nothing left open
        # the same layout is served
        reader = channels.serve("ch2", OUTPUT_SCHEMA)
        nxt = asyncio.ensure_future(reader.__anext__())
        await asyncio.sleep(0)
        channels.get("ch2").deliver([StreamEnd("r", RuntimeError("x"))])
        assert [type(i) for i in await nxt] == [StreamEnd]
        channels.drop("ch2")
        await reader.aclose()

    asyncio.run(scenario())
