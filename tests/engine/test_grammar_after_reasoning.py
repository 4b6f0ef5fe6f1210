"""A reasoning model's grammar starts after its reasoning (``worker/engine/structured.py``):
the tiny Qwen3 with ``<think>`` / ``</think>`` tokens (``tests/thinking_model.py``), greedy
or seeded, a choice constraint. Each prompt state: the template opened the reasoning, closed
an empty one, or left it to the model's first token; reasoning off; forked samples."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvstore.requests.output_constraint import StructuredOutputs
from kvstore.requests.outputs import Completion, FinishReason
from tests.engine.fakes import FakeExecutor
from tests.engine.test_host_tier import HostFakeExecutor
from tests.thinking_model import thinking_model
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.grammar_masks import TokenMask, allow_token
from worker.model.reasoning_markers import ReasoningMarkers
from worker.model.tokenizer import Tokenizer

CHOICES = ("red", "green", "blue")
SPEC = StructuredOutputs.choice(list(CHOICES))
MESSAGES = [{"role": "user", "content": "Pick a colour."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_model(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine.from_model_dir(model_dir, EngineConfig(num_blocks=64))


@pytest.fixture(scope="module")
def off(model_dir: Path) -> Engine:
    return Engine.from_model_dir(model_dir, EngineConfig(num_blocks=64, reasoning="off"))


@pytest.fixture(scope="module")
def markers(engine: Engine) -> ReasoningMarkers:
    assert engine.reasoning is not None
    return engine.reasoning


def prompt(engine: Engine, **template: bool) -> list[int]:
    return engine.tokenizer.encode_chat(MESSAGES, template_kwargs=template)


def run(engine: Engine, ids: list[int], **kw) -> Completion:  # noqa: ANN003
    kw.setdefault("temperature", 0)
    return engine.generate([ids], SamplingParams(**kw))[0].completions[0]


def answer(c: Completion) -> str:
    """The text after the reasoning's end (which decodes as itself: not a special token)."""
    assert c.text.count("</think>") >= 1, c.text
    return c.text.split("</think>", 1)[1]


def test_the_prompt_states(engine: Engine, markers: ReasoningMarkers) -> None:
    assert markers.prompt_state(prompt(engine)) == "none"
    assert markers.prompt_state(prompt(engine, open_thinking=True)) == "open"
    assert markers.prompt_state(prompt(engine, enable_thinking=False)) == "closed"
    assert engine.tokenizer.decode([markers.start_id, markers.end_id]) == "<think></think>"


def test_open_prompt_reasons_freely_then_answers(engine: Engine, markers: ReasoningMarkers) -> None:
    ids = prompt(engine, open_thinking=True)
    end = markers.end_id
    for bias in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0):  # one that ends the reasoning at k >= 2
        free = run(engine, ids, max_tokens=24, logit_bias=((end, bias),)).token_ids
        if end in free[2:] and end not in free[:2]:
            break
    else:
        raise AssertionError("no bias ends the unconstrained reasoning at k >= 2")
    k = free.index(end)
    c = run(engine, ids, max_tokens=24, logit_bias=((end, bias),), structured=SPEC)
    assert c.token_ids[: k + 1] == free[: k + 1]  # no mask while it reasons
    assert answer(c) in CHOICES  # the grammar from the token after </think>, complete
    assert c.finish_reason is FinishReason.STOP
    # reasoning to the end: the constrained output is the unconstrained one
    free = run(engine, ids, max_tokens=12).token_ids
    assert end not in free and len(free) == 12
    assert run(engine, ids, max_tokens=12, structured=SPEC).token_ids == free


def test_first_token_may_open_the_reasoning(engine: Engine, markers: ReasoningMarkers) -> None:
    ids, start, end = prompt(engine), markers.start_id, markers.end_id
    # a large bias: <think> first, despite the grammar, then unconstrained (<think> again)
    bias = ((start, 10.0),)
    c = run(engine, ids, max_tokens=8, logit_bias=bias, structured=SPEC)
    assert c.token_ids == run(engine, ids, max_tokens=8, logit_bias=bias).token_ids
    assert c.token_ids == [start] * 8 and c.finish_reason is FinishReason.LENGTH
    # moderate biases: <think>, a reasoning the model would write after it, </think>, answer
    for sb in (0.0, 0.5, 1.0):
        for eb in (0.5, 1.0, 1.5, 2.0):
            bias = ((start, sb), (end, eb))
            after = run(engine, [*ids, start], max_tokens=20, logit_bias=bias).token_ids
            if end in after[2:] and end not in after[:2]:
                break
        else:
            continue
        break
    else:
        raise AssertionError("no biases end the reasoning at k >= 2")
    k = after.index(end)
    c = run(engine, ids, max_tokens=24, logit_bias=bias, structured=SPEC)
    assert c.token_ids[: k + 2] == [start, *after[: k + 1]]
    assert answer(c) in CHOICES and c.finish_reason is FinishReason.STOP


def test_first_token_not_opening_is_constrained(
    engine: Engine, off: Engine, markers: ReasoningMarkers
) -> None:
    ids = prompt(engine)
    bias = ((markers.start_id, -5.0), (markers.end_id, 5.0))
    c = run(engine, ids, max_tokens=16, logit_bias=bias, structured=SPEC)
    assert c.text in CHOICES and c.finish_reason is FinishReason.STOP
    assert c.token_ids == run(off, ids, max_tokens=16, logit_bias=bias, structured=SPEC).token_ids
    assert engine.processor.openers == 0  # (each request's first token is past)


def test_a_request_ended_before_its_first_token_is_forgotten(engine: Engine) -> None:
    rid = engine.add_request(prompt(engine), SamplingParams(max_tokens=4, structured=SPEC))
    assert engine.processor.openers == 1
    engine.abort(rid)
    engine.step()
    assert engine.processor.openers == 0 and not engine.has_unfinished_requests()


def test_closed_prompt_constrains_from_the_first_token(
    engine: Engine, markers: ReasoningMarkers
) -> None:
    ids = prompt(engine, enable_thinking=False)
    bias = ((markers.start_id, 10.0), (markers.end_id, 10.0))
    assert run(engine, ids, max_tokens=4, logit_bias=bias).token_ids[0] == markers.start_id
    c = run(engine, ids, max_tokens=16, logit_bias=bias, structured=SPEC)
    assert c.text in CHOICES and c.finish_reason is FinishReason.STOP
    assert markers.start_id not in c.token_ids and markers.end_id not in c.token_ids


def test_reasoning_off_constrains_from_the_first_token(
    off: Engine, markers: ReasoningMarkers
) -> None:
    assert off.reasoning is None
    ids = off.tokenizer.encode_chat(MESSAGES, template_kwargs={"open_thinking": True})
    bias = ((markers.end_id, 10.0),)
    assert run(off, ids, max_tokens=4, logit_bias=bias).token_ids[0] == markers.end_id
    c = run(off, ids, max_tokens=16, logit_bias=bias, structured=SPEC)
    assert c.text in CHOICES and c.finish_reason is FinishReason.STOP
    assert markers.end_id not in c.token_ids


def test_forked_samples_hold_their_own_grammar(engine: Engine, markers: ReasoningMarkers) -> None:
    ids, end = prompt(engine, open_thinking=True), markers.end_id
    kw = dict(temperature=1.0, seed=3, n=2, max_tokens=32, logit_bias=((end, 1.5),))
    free = engine.generate([ids], SamplingParams(**kw))[0].completions
    got = engine.generate([ids], SamplingParams(**kw, structured=SPEC))[0].completions
    assert len(got) == 2 and got[0].token_ids != got[1].token_ids
    for c, f in zip(got, free, strict=True):
        assert end in c.token_ids, c.text  # (this seed ends both reasonings)
        k = c.token_ids.index(end)
        assert c.token_ids[: k + 1] == f.token_ids[: k + 1]  # seeded draws, no mask
        assert answer(c) in CHOICES and c.finish_reason is FinishReason.STOP
    alone = engine.generate([ids], SamplingParams(**{**kw, "n": 1}, structured=SPEC))[0]
    assert alone.completions[0].token_ids == got[0].token_ids


def test_min_tokens_bans_eos_while_reasoning(engine: Engine, markers: ReasoningMarkers) -> None:
    """The grammar, held, no longer decides where the output may end: EOS waits for
    min_tokens as in an unconstrained request (the grammar banned it at the first token)."""
    ids, eos = prompt(engine), engine.tokenizer.end_of_turn_token_id
    bias = ((markers.start_id, 10.0), (eos, 20.0))
    kw = dict(max_tokens=12, min_tokens=4, logit_bias=bias)
    c = run(engine, ids, **kw, structured=SPEC)
    assert c.token_ids == run(engine, ids, **kw).token_ids == [markers.start_id] * 4 + [eos]


def test_models_without_markers_are_unchanged(tokenizer) -> None:  # noqa: ANN001
    assert ReasoningMarkers.of(tokenizer) is None
    ex = FakeExecutor(32, 4, max_model_len=64)
    ex.tokenizer, ex.vocab_size = tokenizer, tokenizer.vocab_size
    ex.eos_token_ids = tokenizer.eos_token_ids
    engine = Engine(ex, EngineConfig(block_size=4, max_model_len=64))
    assert engine.reasoning is None and engine.processor.reasoning is None
    c = engine.generate(["Pick:"], SamplingParams(temperature=0, structured=SPEC))[0]
    assert c.completions[0].text in CHOICES
    assert Engine(FakeExecutor(32, 4), EngineConfig(block_size=4)).reasoning is None

    class Stub:  # a tokenizer that cannot list its special ids
        def token_to_id(self, token: str) -> int:
            return 7

    stub = FakeExecutor(32, 4, tokenizer=Stub())
    assert Engine(stub, EngineConfig(block_size=4)).reasoning is None


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_held_grammars_survive_preemption(model_dir: Path, mode: str) -> None:
    """The fake model (exact) with the reasoning tokenizer: sequences preempted while they
    reason or answer keep their matcher, held or not, in step with their tokens."""
    tok = Tokenizer.from_dir(model_dir)

    def engine_on(ex: FakeExecutor, **cfg) -> Engine:  # noqa: ANN003
        ex.tokenizer, ex.vocab_size, ex.eos_token_ids = tok, tok.vocab_size, tok.eos_token_ids
        return Engine(ex, EngineConfig(block_size=4, max_model_len=128, **cfg))

    calm = engine_on(FakeExecutor(96, 4, max_model_len=128))
    markers = calm.reasoning
    assert markers is not None
    end = markers.end_id
    prompts = [[*range(10 + i, 40 + i), markers.start_id] for i in range(5)]  # open
    regex = "[a-z]{30,40}"
    params = SamplingParams(
        temperature=0,
        max_tokens=64,
        logit_bias=((end, 4.0),),
        structured=StructuredOutputs("regex", regex),
    )
    expected = calm.generate(prompts, params)
    pressed = engine_on(
        HostFakeExecutor(30, 4, 128),
        max_num_seqs=4,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        preemption_mode=mode,
    )
    got = pressed.generate(prompts, params)
    assert pressed.metrics().num_preemptions > 0
    for a, b in zip(expected, got, strict=True):
        ids = b.completions[0].token_ids
        assert ids == a.completions[0].token_ids
        assert end in ids[1:]  # (reasoned a while, then answered)
        assert re.fullmatch(regex, answer(b.completions[0])), b.completions[0].text


@pytest.mark.parametrize("every", [True, False])
def test_allow_token_maps_positions_to_mask_rows(every: bool) -> None:
    matchers = ["m", "m", "m"] if every else ["m", None, "m", "m"]
    k = 3
    banned = torch.ones(k, 8, dtype=torch.bool)
    rows = None if every else torch.tensor([0, 2, 3])
    mask = TokenMask(rows, banned)
    positions = [2] if every else [3]  # the last constrained position: mask row 2
    allow_token(mask, matchers, positions, 5)
    assert mask.banned[:, 5].tolist() == [True, True, False]
    assert int(mask.banned.sum()) == k * 8 - 1
