"""A seeded sampled request continued on another engine (its prompt plus the tokens already
sent, as the router submits a moved stream) produces the tokens the uninterrupted run
produced: each draw depends on (seed, sample index, output position) alone, and the
penalties count the earlier output as output."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvstore.requests.errors import InvalidRequest
from tests.engine.fakes import FakeExecutor
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.request import position_seed

PROMPT = [5, 9, 13, 17, 21, 25]
TOTAL = 24


def make() -> Engine:
    return Engine(FakeExecutor(256, 4), EngineConfig(block_size=4, max_model_len=256))


def run(engine: Engine, prompt: list[int], params: SamplingParams, continued: int = 0) -> list:
    rid = engine.add_request(prompt, params, continued=continued)
    out: list[int] = []
    while True:
        for o in engine.step():
            if o.request_id == rid:
                out += o.outputs[0].token_ids if o.outputs else []
                if o.finished:
                    return out


SEEDED = SamplingParams(temperature=1.3, seed=7, max_tokens=TOTAL, ignore_eos=True)
PENALIZED = replace(SEEDED, presence_penalty=0.8, frequency_penalty=1.2, repetition_penalty=1.4)


@pytest.mark.parametrize("params", [SEEDED, PENALIZED], ids=["seeded", "seeded+penalties"])
@pytest.mark.parametrize("k", [1, 9, TOTAL - 1])
def test_a_continuation_draws_what_the_uninterrupted_run_drew(params, k) -> None:
    whole = run(make(), PROMPT, params)
    assert len(whole) == TOTAL
    rest = run(make(), PROMPT + whole[:k], replace(params, max_tokens=TOTAL - k), continued=k)
    assert whole[:k] + rest == whole


def test_the_continuation_needs_its_position() -> None:
    """Submitted as a plain prompt (position 0, no earlier output), the same continuation
    draws other tokens: the test above measures the mechanism, not luck."""
    whole = run(make(), PROMPT, SEEDED)
    plain = run(make(), PROMPT + whole[:9], replace(SEEDED, max_tokens=TOTAL - 9))
    assert plain != whole[9:]


def test_seeded_runs_reproduce_alone_and_in_a_batch() -> None:
    engine = make()
    alone = run(engine, PROMPT, SEEDED)
    assert run(make(), PROMPT, SEEDED) == alone
    crowd = engine.generate(
        [[7, 8], PROMPT, [30, 31, 32, 33]],
        [SamplingParams(temperature=1.0, max_tokens=30), SEEDED, SamplingParams(n=3, seed=1)],
    )
    assert crowd[1].completions[0].token_ids == alone
    assert run(make(), PROMPT, replace(SEEDED, seed=8)) != alone


def test_positions_and_seeds_get_distinct_draw_seeds() -> None:
    seeds = {position_seed(base, pos) for base in range(64) for pos in range(64)}
    assert len(seeds) == 64 * 64
    assert all(0 <= s < 2**63 for s in seeds)


def test_continued_must_leave_a_prompt_token() -> None:
    engine = make()
    for bad in (-1, len(PROMPT)):
        with pytest.raises(InvalidRequest, match="continued"):
            engine.add_request(PROMPT, SEEDED, continued=bad)
