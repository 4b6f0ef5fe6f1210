"""Requests built to hurt a worker (issue 13): one request's failure is its own.

A request whose processing raises ends with an error while the others keep streaming and the
engine serves new ones; beam search with any length penalty neither overflows nor ends
without a completion; a million stop token ids is refused up front; a dead loop is reported.
"""

from __future__ import annotations

import threading

import pytest

from tests.engine.fakes import FakeExecutor, reference_generate
from tests.engine.helpers import assert_no_blocks_in_use, run_all
from worker.engine import (
    Engine,
    EngineConfig,
    EngineLoop,
    EngineStopped,
    FinishReason,
    InvalidRequest,
    SamplingParams,
)
from worker.engine.processor import OutputProcessor

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[3 + i, 10 + i, 20, 30 + i] * 2 for i in range(4)]


def make(num_blocks: int = 128, **cfg) -> Engine:
    cfg.setdefault("max_model_len", 256)
    return Engine(FakeExecutor(num_blocks, 4), EngineConfig(block_size=4, **cfg))


def poison(monkeypatch: pytest.MonkeyPatch, victim: str, after: int = 3) -> None:
    """``victim``'s processing raises once it has ``after`` tokens (a bug only it hits)."""
    original = OutputProcessor._append

    def append(self, req, seq, tok, *rest) -> None:  # noqa: ANN001
        if req.request_id == victim and seq.num_output >= after:
            raise ZeroDivisionError("injected failure of one request")
        original(self, req, seq, tok, *rest)

    monkeypatch.setattr(OutputProcessor, "_append", append)


def unvalidated(params: SamplingParams, **fields: object) -> SamplingParams:
    """``params`` with fields past validation (as if a check were missing upstream)."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def test_a_failing_request_ends_alone_and_the_others_keep_streaming(monkeypatch) -> None:
    poison(monkeypatch, "poison")
    with EngineLoop(make()) as front:
        streams = [
            front.add_request(p, GREEDY, request_id=f"ok-{i}") for i, p in enumerate(PROMPTS)
        ]
        bad = front.add_request([7, 8, 9], GREEDY, request_id="poison")
        results: dict[str, object] = {}

        def drain(stream) -> None:  # noqa: ANN001
            results[stream.request_id] = stream.collect()

        threads = [threading.Thread(target=drain, args=(s,)) for s in [*streams, bad]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        failed = results["poison"]
        assert failed.error is not None and "ZeroDivisionError" in failed.error
        assert failed.completions[0].finish_reason is FinishReason.ABORT
        for i, p in enumerate(PROMPTS):
            res = results[f"ok-{i}"]
            assert res.error is None
            assert res.completions[0].token_ids == reference_generate(p, 12, ignore_eos=True)
        # the engine still serves new requests, and the failed one left no block behind
        again = front.add_request(PROMPTS[0], GREEDY).collect()
        assert again.completions[0].token_ids == reference_generate(PROMPTS[0], 12, ignore_eos=True)
        assert front.alive
        with front.paused() as engine:
            assert_no_blocks_in_use(engine)


def test_a_failure_outside_any_request_fails_the_running_ones_and_the_engine_goes_on(
    monkeypatch,
) -> None:
    engine = make()
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    engine.step()

    def broken() -> None:
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    outs = engine.step()
    assert {o.request_id for o in outs if o.finished and o.error} == set(ids)
    monkeypatch.undo()
    assert_no_blocks_in_use(engine)
    rid = engine.add_request(PROMPTS[3], GREEDY)
    assert run_all(engine)[rid].completions[0].token_ids == reference_generate(
        PROMPTS[3], 12, ignore_eos=True
    )


def test_a_dead_loop_refuses_requests_and_reports_its_death() -> None:
    died: list[BaseException] = []
    engine = make()
    front = EngineLoop(engine, on_death=died.append, idle_wait_s=0.01).start()

    def boom() -> list:
        raise MemoryError("state beyond repair")

    # before the request: the loop takes it in, then its first step dies (set after it, the
    # loop could finish all 12 steps before this thread runs again)
    engine.step = boom  # type: ignore[method-assign]
    stream = front.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(EngineStopped, match="loop died"):
        stream.collect()
    assert not front.alive and len(died) == 1 and isinstance(died[0], MemoryError)
    with pytest.raises(EngineStopped, match="loop died"):
        front.add_request(PROMPTS[1], GREEDY)


@pytest.mark.parametrize(("penalty", "max_tokens"), [(2000.0, 8), (150.0, 160), (-1000.0, 8)])
def test_beam_scores_never_overflow_and_always_end_with_a_completion(penalty, max_tokens):
    """The attack: ``(len + 1) ** 2000`` raised OverflowError in the engine's thread."""
    engine = make()
    # ignore_eos: beams finish only at max length, where len ** penalty is extreme
    params = unvalidated(
        SamplingParams(beam_width=3, n=3, max_tokens=max_tokens, ignore_eos=True),
        length_penalty=penalty,
    )
    rid = engine.add_request(PROMPTS[1], params)
    res = run_all(engine)[rid]
    assert res.error is None and len(res.completions) == 3
    assert all(c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for c in res.completions)
    assert all(len(c.token_ids) == max_tokens for c in res.completions)
    assert_no_blocks_in_use(engine)


def test_length_penalty_out_of_range_is_invalid() -> None:
    for value in (2000.0, -1000.0, 10.5):
        with pytest.raises(InvalidRequest) as exc:
            SamplingParams(beam_width=2, length_penalty=value)
        assert exc.value.field == "length_penalty" and exc.value.value == value
        assert "[-10, 10]" in exc.value.limit
    SamplingParams(beam_width=2, length_penalty=-10.0)


def test_every_token_banned_is_refused_up_front() -> None:
    engine = make()  # vocabulary of 64, EOS = 1
    everything = tuple(t for t in range(64) if t != 1)
    with pytest.raises(InvalidRequest) as exc:
        engine.add_request(
            [5, 6], SamplingParams(min_tokens=2, stop_token_ids=everything, beam_width=2)
        )
    assert exc.value.field == "stop_token_ids" and "vocab_size=64" in exc.value.limit
    # one token left: allowed (EOS ignored counts as not banned)
    rid = engine.add_request(
        [5, 6],
        SamplingParams(min_tokens=2, stop_token_ids=everything, ignore_eos=True, max_tokens=3),
    )
    assert run_all(engine)[rid].completions[0].token_ids[:2] == [1, 1]


def test_beam_with_every_candidate_impossible_still_returns_a_completion(monkeypatch) -> None:
    monkeypatch.setattr("worker.engine.engine.validate_request", lambda *a, **k: None)
    engine = make()
    banned = tuple(t for t in range(64) if t != 1)
    params = SamplingParams(beam_width=2, max_tokens=4, min_tokens=2, stop_token_ids=banned)
    rid = engine.add_request([5, 6], params)
    res = run_all(engine)[rid]
    assert res.error is None and res.completions
    assert all(c.finish_reason is not None for c in res.completions)
    assert_no_blocks_in_use(engine)


def test_stop_token_ids_and_stop_strings_are_bounded() -> None:
    with pytest.raises(InvalidRequest) as exc:
        SamplingParams(stop_token_ids=range(1_000_000))
    assert exc.value.field == "stop_token_ids" and exc.value.value == "<1000000 ids>"
    assert "at most 128" in exc.value.limit
    with pytest.raises(InvalidRequest, match="at most 256 characters"):
        SamplingParams(stop=["x" * 257])
    with pytest.raises(InvalidRequest, match="at most 16 strings"):
        SamplingParams(stop=["x"] * 17)
    p = SamplingParams(stop_token_ids=list(range(128)), stop=["y" * 256])
    assert p.stop_token_set == frozenset(range(128))  # the per-token check is a set lookup


def test_a_stop_token_id_in_the_set_stops() -> None:
    engine = make()
    want = reference_generate(PROMPTS[2], 12, ignore_eos=True)
    stop = want[4]
    rid = engine.add_request(
        PROMPTS[2],
        SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(60, stop, 61)
        ),
    )
    c = run_all(engine)[rid].completions[0]
    assert c.finish_reason is FinishReason.STOP and c.token_ids == want[: want.index(stop) + 1]
