"""Speculative decoding in the engine: greedy outputs token-identical with and without it,
draft slots never cached or published, no block leaks, features that turn it off."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.blocks.events import BlockStored
from kvstore.requests.sampling_params import SamplingParams
from tests.engine.fakes import FakeExecutor
from tests.engine.helpers import assert_no_blocks_in_use
from tests.engine.test_scheduler import prompts
from worker.engine import Engine, EngineConfig


def engine_of(tiny_dir: Path, method: str, **spec: object) -> Engine:
    cfg = EngineConfig(
        num_blocks=96,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        speculative={"method": method, **spec},
    )
    return Engine.from_model_dir(tiny_dir, cfg)


def run(engine: Engine, batches: list[list[tuple[list[int], SamplingParams]]]):
    """Each batch to completion in turn (later batches see earlier outputs: suffix corpus);
    invariants after every step. Returns tokens per request and the stored block keys."""
    tokens: list[list[int]] = []
    stored: set = set()
    for batch in batches:
        ids = [engine.add_request(p, sp) for p, sp in batch]
        got: dict[str, dict[int, list[int]]] = {i: {} for i in ids}
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                for c in out.outputs:
                    got[out.request_id].setdefault(c.index, []).extend(c.token_ids)
            engine.kv.check_invariants()
            for ev in engine.drain_kv_events():
                if isinstance(ev, BlockStored):
                    stored.update(ev.keys)
        tokens += [[t for _, ts in sorted(got[i].items()) for t in ts] for i in ids]
        assert_no_blocks_in_use(engine)
    return tokens, stored


def workload() -> list[list[tuple[list[int], SamplingParams]]]:
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    stop = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(17,))
    rep = [5, 6, 7, 8, 9] * 6
    code = list(range(30, 70))
    first = [(rep, greedy), (code, greedy), (code + [3], short), ([11, 12] * 9, stop)]
    again = [(code, greedy), (code[:20] + [99] + code[21:], greedy), (rep[:-2], greedy)]
    return [first, again]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_outputs_identical_with_and_without_speculation(
    tiny_dir: Path, method: str, adaptive: bool
) -> None:
    plain, plain_keys = run(engine_of(tiny_dir, "none"), workload())
    engine = engine_of(
        tiny_dir, method, adaptive=adaptive, num_speculative_tokens=4, prompt_lookup_min=1
    )
    spec, spec_keys = run(engine, workload())
    assert spec == plain
    # draft slots never reach the prefix cache or the events: every block published holds
    # verified tokens only (a request finishing inside a verify step leaves the blocks its
    # last drafts filled uncached: a subset)
    assert spec_keys <= plain_keys
    snap = engine.snapshot()
    assert snap.spec_decode_num_drafts > 0
    assert 0 < snap.spec_decode_num_accepted_tokens <= snap.spec_decode_num_draft_tokens
    per_pos = snap.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == snap.spec_decode_num_accepted_tokens
    assert list(per_pos) == sorted(per_pos, reverse=True)  # position i needs i-1 accepted
    # a verified token counts as generated once: the engine's count equals the outputs'
    assert snap.generation_tokens == sum(map(len, spec))


def test_requests_that_turn_speculation_off_run_plain_and_match(tiny_dir: Path) -> None:
    prompt = [5, 6, 7, 8, 9] * 6
    kinds = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=((3, 1.0),)),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=3),
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7),
        SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, n=2, seed=3),
        SamplingParams(max_tokens=12, ignore_eos=True, beam_width=2),
    ]
    batches = [[(prompt, p)] for p in kinds]
    plain, _ = run(engine_of(tiny_dir, "none"), batches)
    engine = engine_of(tiny_dir, "ngram", prompt_lookup_min=1)
    spec, _ = run(engine, batches)
    assert spec == plain
    assert engine.snapshot().spec_decode_num_drafts == 0


def test_sampled_requests_speculate_and_finish_their_length(tiny_dir: Path) -> None:
    engine = engine_of(tiny_dir, "ngram", prompt_lookup_min=1, adaptive=False)
    p = SamplingParams(temperature=0.7, top_k=3, max_tokens=30, ignore_eos=True)
    tokens, _ = run(engine, [[([5, 6, 7, 8, 9] * 6, p)] * 3])
    assert [len(t) for t in tokens] == [30, 30, 30]
    assert engine.snapshot().spec_decode_num_drafts > 0


def fake_engine(method: str, window: int | None, **cfg: object) -> Engine:
    ex = FakeExecutor(28, 4)
    ex.context_window = window
    config = EngineConfig(
        block_size=4,
        num_blocks=28,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        max_model_len=256,
        speculative={"method": method, "prompt_lookup_min": 1, **cfg},
    )
    return Engine(ex, config)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("window", [1, 2, None])
def test_speculation_under_preemption_matches_and_leaks_nothing(
    method: str, window: int | None
) -> None:
    """A small pool and budget: drafts compete with prefills, requests are preempted and
    recomputed; the fake model checks every slot it reads holds the right token."""
    ps = prompts(14, 4, 28, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    batches = [[(p, params) for p in ps[:7]], [(p, params) for p in ps[7:]]]
    plain_engine = fake_engine("none", window)
    plain, _ = run(plain_engine, batches)
    engine = fake_engine(method, window, num_speculative_tokens=6)
    spec, _ = run(engine, batches)
    assert spec == plain
    snap = engine.snapshot()
    assert snap.num_preemptions > 0
    if window is not None:  # repeating outputs: drafts accepted
        assert snap.spec_decode_num_accepted_tokens > 0


def test_telemetry_counts_spec_decode_by_deltas() -> None:
    from tests.worker.test_telemetry import FAKE_METRICS
    from worker.telemetry import WorkerTelemetry

    engine = fake_engine("ngram", 1, adaptive=False)
    tel = WorkerTelemetry("w", metrics_api=FAKE_METRICS)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for p in prompts(4, 4, 12, seed=2):
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        tel.after_step(engine.snapshot(), engine.step())
    tel.after_step(engine.snapshot(), [])
    snap = engine.snapshot()
    assert snap.spec_decode_num_accepted_tokens > 0
    for name, counter in tel.spec.items():
        assert counter.name == f"kvc_{name}"
        assert sum(counter.incs) == getattr(snap, name)
    assert sum(tel.spec_per_pos.incs) == snap.spec_decode_num_accepted_tokens


def test_speculator_stops_when_a_verify_step_does_not_pay_and_probes_again() -> None:
    from worker.engine.config import SpeculativeConfig
    from worker.engine.speculator import MAX_PROBE_EVERY, PROBE_EVERY, Speculator

    spec = Speculator(SpeculativeConfig(method="ngram"))

    def step(num_decoding: int, rates: dict[bool, float]) -> bool:
        """One decode step at that load, measured at ``rates`` tok/s; whether it speculated."""
        spec.begin_step()
        speculated = spec.speculating(num_decoding)
        spec.end_step(speculated, 10, 10 / rates[speculated])
        return speculated

    slow = {False: 100.0, True: 50.0}  # a verify step that does not pay
    # a load not measured yet: one step with drafts, one without, then the one that pays
    assert [step(64, slow) for _ in range(2)] == [True, False]
    assert not spec.on
    decisions = [step(64, slow) for _ in range(1000)]
    probes = [i for i, d in enumerate(decisions) if d]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    # a probe now and then, each that confirms "off" doubling the gap to the next
    assert probes[0] == PROBE_EVERY  # the first gap counts from the first choice
    assert gaps[:4] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY, MAX_PROBE_EVERY]
    assert set(gaps[4:]) == {MAX_PROBE_EVERY}
    # another load is measured on its own: at one sequence, speculating pays
    fast = {False: 20.0, True: 40.0}
    ones = [step(1, fast) for _ in range(2 * PROBE_EVERY)]
    assert spec.on and ones.count(False) == 2  # its first plain step, then one probe
    step(64, slow)
    assert not spec.on  # back at 64: still off (that load's own measures)
    fixed = {False: 100.0, True: 300.0}  # the probes now measure it paying
    for _ in range(2 * MAX_PROBE_EVERY):
        step(64, fixed)
    assert spec.on
    assert not SpeculativeConfig(method="ngram", adaptive=False).adaptive


def test_a_probe_measures_afresh_a_stale_measure_keeps_nothing_off() -> None:
    from worker.engine.config import SpeculativeConfig
    from worker.engine.speculator import PROBE_EVERY, Speculator

    spec = Speculator(SpeculativeConfig(method="ngram"))

    def step(rates: dict[bool, float]) -> bool:
        spec.begin_step()
        speculated = spec.speculating(64)
        spec.end_step(speculated, 10, 10 / rates[speculated])
        return speculated

    # first measured while another job loaded the machine: a verify step looked slow
    assert [step({False: 50.0, True: 40.0}) for _ in range(2)] == [True, False]
    assert not spec.on
    pays = {False: 100.0, True: 150.0}  # the load is gone, speculation pays
    after = [step(pays) for _ in range(PROBE_EVERY + 2)]
    # plain until the probe, which measures it paying: on from then on (averaged with the
    # stale measure instead, the probe would confirm "off" and double the gap)
    probe = after.index(True)
    assert probe > 0 and not any(after[:probe]) and all(after[probe:])
    assert spec.on


def test_config_rejects_unknown_keys_and_inverted_lookup_bounds() -> None:
    from pydantic import ValidationError

    from worker.engine.config import SpeculativeConfig

    with pytest.raises(ValidationError, match="extra"):
        EngineConfig(speculative={"method": "ngram", "draft_model": "x"})
    with pytest.raises(ValidationError, match="prompt_lookup_min=4 > prompt_lookup_max=2"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValidationError):
        SpeculativeConfig(method="eagle")


def test_stop_strings_and_lora_speculate_with_identical_outputs(tiny_dir: Path, tmp_path) -> None:
    from worker.model.build_tiny_lora import build_tiny_lora

    lora = str(build_tiny_lora(tmp_path / "a1", tiny_dir, seed=1, rank=8))

    def make(method: str) -> Engine:
        cfg = EngineConfig(
            num_blocks=96,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_loras=1,
            max_lora_rank=8,
            lora_adapters={"a1": lora},
            speculative={"method": method, "prompt_lookup_min": 1},
        )
        return Engine.from_model_dir(tiny_dir, cfg)

    plain_engine = make("none")
    prompt = [5, 6, 7, 8, 9] * 6
    greedy = dict(temperature=0, max_tokens=30, ignore_eos=True)
    probe = run(plain_engine, [[(prompt, SamplingParams(**greedy))]])[0][0]
    text = plain_engine.tokenizer.decode(probe[8:10])  # a stop string met mid-output
    batches = [
        [
            (prompt, SamplingParams(**greedy, lora="a1")),
            (prompt, SamplingParams(**greedy, stop=(text,))),
        ]
    ]
    plain, _ = run(make("none"), batches)
    engine = make("suffix")
    spec, _ = run(engine, batches)
    assert spec == plain
    assert len(spec[1]) < 30  # the stop string ended it
    assert engine.snapshot().spec_decode_num_drafts > 0


@pytest.mark.parametrize(
    ("kw", "speculates"),
    [
        ({}, True),
        ({"temperature": 0.7, "top_p": 0.9}, True),
        ({"stop": ("x",), "lora": "a"}, True),
        ({"structured": "json_object"}, False),
        ({"logprobs": 0}, False),
        ({"prompt_logprobs": 0}, False),
        ({"frequency_penalty": 0.1}, False),
        ({"repetition_penalty": 1.1}, False),
        ({"logit_bias": ((1, 2.0),)}, False),
        ({"allowed_token_ids": (1, 2)}, False),
        ({"bad_words": ("x",)}, False),
        ({"min_tokens": 2}, False),
        ({"seed": 1}, False),
        ({"n": 2}, False),
        ({"beam_width": 2}, False),
    ],
)
def test_which_requests_speculate(kw: dict, speculates: bool) -> None:
    from types import SimpleNamespace

    from kvstore.requests.output_constraint import StructuredOutputs
    from worker.engine.speculator import eligible

    if "structured" in kw:
        kw = {**kw, "structured": StructuredOutputs(kw["structured"])}
    p = SamplingParams(max_tokens=8, **kw)
    req = SimpleNamespace(params=p, prompt_logprobs=[] if p.prompt_logprobs is not None else None)
    assert eligible(req) is speculates  # type: ignore[arg-type]


def test_spec_counters_reach_the_routers_metrics_in_vllm_names() -> None:
    """The engine's counters travel in the worker's status to the router's ``/metrics``,
    named as vLLM names them; they move after a speculative request."""
    from prometheus_client.parser import text_string_to_metric_families

    from router.serving.serving_metrics import ServingMetrics
    from worker.status import worker_status

    engine = fake_engine("ngram", 1, adaptive=False)
    metrics = ServingMetrics("m")

    def scrape() -> dict[tuple[str, str], float]:
        status = worker_status("w0", engine.snapshot(), epoch=1, index_healthy=True)
        text = metrics.render([status]).decode()
        return {
            (s.name, s.labels.get("position", "")): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name.startswith("vllm:spec_decode_") and s.labels["worker"] == "w0"
        }

    before = scrape()
    assert before[("vllm:spec_decode_num_drafts_total", "")] == 0
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for p in prompts(4, 4, 12, seed=2):
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()
    after = scrape()
    snap = engine.snapshot()
    assert snap.spec_decode_num_accepted_tokens > 0
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert after[(f"vllm:spec_decode_{name}_total", "")] == getattr(snap, f"spec_decode_{name}")
    per_pos = {
        int(pos): v
        for (name, pos), v in after.items()
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos and sum(per_pos.values()) == snap.spec_decode_num_accepted_tokens
    assert per_pos[0] > 0


def test_non_finite_verify_rows_fail_their_request_alone(tiny_dir: Path) -> None:
    """The step's verify rows are sampled in one call: NaN in one chunk's rows fails that
    request, and the other request verifying in the same step goes on as without it."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    good, bad = [5, 6, 7, 8, 9] * 6, [11, 12, 13] * 8
    (plain,), _ = run(engine_of(tiny_dir, "none"), [[(good, greedy)]])
    engine = engine_of(tiny_dir, "ngram", adaptive=False, prompt_lookup_min=1)
    execute = engine.executor.execute
    poisoned = []

    def poison(chunks):  # NaN in the bad request's verify rows, once both verify
        logits = execute(chunks)
        rows, row = {}, 0
        for c in (c for c in chunks if c.wants_logits):
            rows[c.req.request_id] = (row, len(c.drafts)) if c.drafts else None
            row += 1 + len(c.drafts)
        if not poisoned and len(rows) == 2 and all(rows.values()):
            start, n = rows[bad_id]
            logits[start : start + n + 1] = float("nan")
            poisoned.append(True)
        return logits

    engine.executor.execute = poison
    good_id, bad_id = engine.add_request(good, greedy), engine.add_request(bad, greedy)
    got: dict[str, list[int]] = {good_id: [], bad_id: []}
    errors = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += [t for c in out.outputs for t in c.token_ids]
            if out.error is not None:
                errors[out.request_id] = out.error
    assert poisoned
    assert "non-finite logits" in errors[bad_id] and good_id not in errors
    assert got[good_id] == plain
    assert_no_blocks_in_use(engine)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_prompts_take_the_budget_before_drafts(method: str) -> None:
    """While a prompt is to be computed (a running request's, or a waiting one the batch has
    room for), a step carries no drafts; decode-only steps do. Outputs match plain runs."""
    ps = prompts(10, 4, 28, seed=7)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    batches = [[(p, params) for p in ps[:2]], [(p, params) for p in ps[2:]]]
    plain, _ = run(fake_engine("none", 2), batches)
    engine = fake_engine(method, 2, num_speculative_tokens=4, adaptive=False)
    steps = []
    schedule = engine.scheduler.schedule

    def recorded(*args, **kwargs):
        out = schedule(*args, **kwargs)
        steps.append((out.num_prefill_tokens, out.num_draft_tokens))
        return out

    engine.scheduler.schedule = recorded
    spec, _ = run(engine, batches)
    assert spec == plain
    assert any(drafts for _, drafts in steps)  # decode-only steps speculate
    assert any(prefill for prefill, _ in steps)
    assert not any(prefill and drafts for prefill, drafts in steps)


def test_a_request_whose_drafts_keep_missing_pauses_drafting_and_resumes_on_a_hit() -> None:
    from types import SimpleNamespace

    from worker.engine.config import SpeculativeConfig
    from worker.engine.speculator import MAX_PAUSE, Speculator

    spec = Speculator(SpeculativeConfig(method="ngram"))
    req = SimpleNamespace(
        request_id="r",
        params=SamplingParams(max_tokens=512),
        prompt_ids=[1, 2, 3],
        prompt_logprobs=None,
    )
    spec.start(req)  # type: ignore[arg-type]
    spec.proposer.propose = lambda rid, tokens, k: [7] * k  # type: ignore[method-assign]
    seq = SimpleNamespace(token_ids=[1, 2, 3])

    def run(steps: int, accepted: int) -> list[int]:
        """The steps (numbered from 1 here) in which the request drafted."""
        drafted = []
        for i in range(1, steps + 1):
            spec.begin_step()
            drafts = spec.draft(req, seq, 8, 1)  # type: ignore[arg-type]
            if drafts:
                drafted.append(i)
                spec.verified(req, len(drafts), min(accepted, len(drafts)))  # type: ignore[arg-type]
        return drafted

    # two misses in a row, then pauses of 2, 4, 8, ... steps with one try after each
    missed = run(40, accepted=0)
    assert missed[:5] == [1, 2, 5, 10, 19]
    gaps = [b - a - 1 for a, b in zip(missed[1:], missed[2:], strict=False)]
    assert gaps == [2, 4, 8, 16][: len(gaps)]
    late = run(8 * MAX_PAUSE, accepted=0)
    assert max(b - a - 1 for a, b in zip(late, late[1:], strict=False)) == MAX_PAUSE
    # a try that hits: the request drafts every step again
    while not run(1, accepted=2):
        pass
    assert run(10, accepted=2) == list(range(1, 11))
