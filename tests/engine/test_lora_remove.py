"""Unloading a LoRA adapter registered at run time (``Engine.remove_lora``) on the tiny Llama:
its requests end with an error naming it wherever they are, the rest of the batch runs on
unchanged, no block leaks, and the name can be registered again."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstore.requests.output_constraint import StructuredOutputs
from tests.engine.helpers import assert_no_blocks_in_use, run_all
from worker.engine import (
    Engine,
    EngineConfig,
    GenerationResult,
    InvalidRequest,
    RequestOutput,
    SamplingParams,
)
from worker.engine.commands import RemoveLora
from worker.engine.engine_loop import EngineLoop
from worker.engine.request import RequestStatus
from worker.model.build_tiny_lora import build_tiny_lora
from worker.model.lora import LoraError

MAX_NEW = 12
UNLOADED = "adapter 'a1' was unloaded"
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(5, 512) for _ in range(n)] for n in (20, 37, 9)]
ADAPTERS = {"a1": dict(seed=1, rank=8), "a2": dict(seed=2, rank=4), "cfg": dict(seed=3, rank=4)}


@pytest.fixture(scope="module")
def lora_dirs(tiny_dir: Path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {n: str(build_tiny_lora(root / n, tiny_dir, **kw)) for n, kw in ADAPTERS.items()}


def engine_with(tiny_dir: Path, lora_dirs: dict[str, str], **cfg) -> Engine:
    """``cfg`` from the engine config; ``a1`` (for bob only) and ``a2`` added at run time."""
    cfg.setdefault("num_blocks", 64)
    engine = Engine.from_model_dir(
        tiny_dir, EngineConfig(lora_adapters={"cfg": lora_dirs["cfg"]}, **cfg)
    )
    engine.add_lora("a1", lora_dirs["a1"], ["bob"])
    engine.add_lora("a2", lora_dirs["a2"])
    return engine


def params(adapter: str | None, max_tokens: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, lora=adapter, **kw
    )


def fold(results: dict[str, GenerationResult], outs: list[RequestOutput]) -> None:
    for out in outs:
        results.setdefault(out.request_id, GenerationResult(out.request_id, [])).add(out)


def tokens(results, rid: str) -> list[int]:  # noqa: ANN001
    res = results[rid]
    assert res.error is None, res.error
    return res.completions[0].token_ids


# base, a2, a1 running; a1 queued behind them (max_num_seqs=3); cfg after it
BATCH = [("base", None, 0), ("a2", "a2", 1), ("a1-run", "a1", 2), ("a1-wait", "a1", 0)]


def add_batch(engine: Engine) -> None:
    for rid, adapter, p in BATCH:
        engine.add_request(PROMPTS[p], params(adapter), request_id=rid)
    engine.add_request(PROMPTS[1], params("cfg"), request_id="cfg")


def test_removal_ends_its_requests_and_spares_the_rest(tiny_dir, lora_dirs) -> None:
    kept = ("base", "a2", "cfg")
    ref = engine_with(tiny_dir, lora_dirs, max_num_seqs=3)
    add_batch(ref)
    want = run_all(ref)
    assert all(want[rid].error is None for rid in want)

    engine = engine_with(tiny_dir, lora_dirs, max_num_seqs=3)
    a1_id = engine.loras["a1"]
    add_batch(engine)
    got: dict[str, GenerationResult] = {}
    for _ in range(3):  # prefills done, a few tokens decoded
        fold(got, engine.step())
    status = {rid: engine.requests[rid].status for rid in ("a1-run", "a1-wait")}
    assert status == {"a1-run": RequestStatus.RUNNING, "a1-wait": RequestStatus.WAITING}
    assert "a1" in engine.executor.loaded_loras()
    # one more of a1, still waiting for its grammar: it ends too
    spec = StructuredOutputs.choice(["red", "green"])
    engine.add_request(PROMPTS[2], params("a1", structured=spec), request_id="a1-grammar")
    assert engine.requests["a1-grammar"].awaiting_grammar

    assert engine.remove_lora("a1") is True
    assert not {"a1-run", "a1-wait", "a1-grammar"} & set(engine.requests)
    assert "a1" not in engine.loras and "a1" not in engine.lora_tenants
    assert "a1" not in engine.executor.loaded_loras()
    assert "a1" not in engine.executor.runner.lora.slot_of
    snap = engine.snapshot()
    assert a1_id not in snap.lora_ids and snap.lora_owners == ()

    while engine.has_unfinished_requests():
        fold(got, engine.step())
    for rid in ("a1-run", "a1-wait", "a1-grammar"):
        assert got[rid].error == UNLOADED, rid
        assert all(c.finish_reason == "abort" for c in got[rid].completions), rid
    assert got["a1-run"].completions[0].token_ids  # it had decoded before
    for rid in kept:
        assert tokens(got, rid) == tokens(want, rid), rid
    assert_no_blocks_in_use(engine)
    assert engine._num_constrained == 0 and engine._compiling == []


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_request_ends_too(tiny_dir, lora_dirs, mode) -> None:
    # 8 blocks for three requests growing from 2 to 3 blocks each: the newest (a1's) is preempted
    cfg = dict(num_blocks=8, preemption_mode=mode, host_kv_bytes=(4 << 20) * (mode == "swap"))
    reqs = [("base", None), ("a2", "a2"), ("a1", "a1")]

    def start(engine: Engine) -> None:
        for rid, adapter in reqs:
            engine.add_request(PROMPTS[0], params(adapter, max_tokens=24), request_id=rid)

    ref = engine_with(tiny_dir, lora_dirs, **cfg)
    start(ref)
    want = run_all(ref)
    engine = engine_with(tiny_dir, lora_dirs, **cfg)
    start(engine)
    got: dict[str, GenerationResult] = {}
    a1 = engine.requests["a1"]
    for _ in range(40):
        fold(got, engine.step())
        if a1.status is RequestStatus.PREEMPTED:
            break
    assert a1.status is RequestStatus.PREEMPTED and a1.num_preemptions == 1
    assert engine.remove_lora("a1")
    while engine.has_unfinished_requests():
        fold(got, engine.step())
    assert got["a1"].error == UNLOADED
    for rid in ("base", "a2"):
        assert tokens(got, rid) == tokens(want, rid), rid
    assert_no_blocks_in_use(engine)
    if mode == "swap":
        assert engine.metrics().num_swap_preemptions == 1


def test_generating_with_a_removed_adapter_is_invalid(tiny_dir, lora_dirs) -> None:
    engine = engine_with(tiny_dir, lora_dirs)
    assert engine.remove_lora("a1")
    with pytest.raises(InvalidRequest, match=r"lora='a1': unknown adapter; served: a2, cfg"):
        engine.add_request(PROMPTS[0], params("a1"))
    assert engine.remove_lora("a1") is False  # already gone
    assert not engine.has_unfinished_requests()


def test_unknown_and_config_adapters(tiny_dir, lora_dirs) -> None:
    engine = engine_with(tiny_dir, lora_dirs)
    assert engine.remove_lora("nope") is False
    with pytest.raises(
        LoraError,
        match=r"'cfg'.*registered by the cluster config \(workers\.engine\.lora_adapters\)",
    ):
        engine.remove_lora("cfg")
    assert set(engine.loras) == {"a1", "a2", "cfg"}
    assert engine.generate([PROMPTS[0]], params("cfg"))[0].error is None


def test_registering_again_serves_again(tiny_dir, lora_dirs) -> None:
    engine = engine_with(tiny_dir, lora_dirs)
    a1_id = engine.loras["a1"]
    before = engine.generate([PROMPTS[0], PROMPTS[0]], [params("a1"), params("a2")])
    a1_out, a2_out = (r.completions[0].token_ids for r in before)
    assert a1_out != a2_out
    assert engine.remove_lora("a1")
    assert engine.add_lora("a1", lora_dirs["a1"]) == a1_id  # the same folder: the same id
    assert engine.generate([PROMPTS[0]], params("a1"))[0].completions[0].token_ids == a1_out
    # another folder under the name: its weights, not the old slot's
    assert engine.remove_lora("a1")
    assert engine.add_lora("a1", lora_dirs["a2"]) != a1_id
    assert engine.generate([PROMPTS[0]], params("a1"))[0].completions[0].token_ids == a2_out
    assert_no_blocks_in_use(engine)


def test_the_engine_loop_ends_the_stream_with_the_error(tiny_dir, lora_dirs) -> None:
    engine = engine_with(tiny_dir, lora_dirs)
    with EngineLoop(engine) as loop:
        stream = loop.add_request(PROMPTS[0], params("a1", max_tokens=200))
        assert loop.call(RemoveLora("a1")) is True
        outs = list(stream)
        assert outs[-1].finished and outs[-1].error == UNLOADED
        assert loop.call(RemoveLora("a1")) is False
        with pytest.raises(LoraError, match="'cfg'"):
            loop.call(RemoveLora("cfg"))
        with loop.paused() as e:
            assert_no_blocks_in_use(e)
