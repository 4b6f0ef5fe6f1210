"""LoRA serving on the tiny Llama against ``transformers`` + ``peft`` as the reference."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import Engine, EngineConfig, InvalidRequest, SamplingParams
from worker.model.build_tiny_lora import build_tiny_lora
from worker.model.lora import LoraError

peft = pytest.importorskip("peft")

EOS = (2, 4)
MAX_NEW = 16
_rng = random.Random(5)
SHARED = [_rng.randrange(5, 512) for _ in range(48)]  # 3 full blocks: a shared system prompt
PROMPTS = [SHARED + [_rng.randrange(5, 512) for _ in range(n)] for n in (5, 21, 40)]
ADAPTERS = {  # name -> builder kwargs: different ranks and target sets
    "a1": dict(seed=1, rank=8),
    "a2": dict(seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj")),
    "a3": dict(seed=3, rank=16, alpha=8.0, targets=("k_proj", "o_proj", "gate_proj", "up_proj")),
}


@pytest.fixture(scope="module")
def lora_dirs(tiny_dir: Path, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {n: str(build_tiny_lora(root / n, tiny_dir, **kw)) for n, kw in ADAPTERS.items()}


@pytest.fixture(scope="module")
def reference(tiny_dir: Path, lora_dirs: dict[str, str]):
    """(prompt, adapter) -> greedy tokens from transformers + peft (min_tokens = MAX_NEW)."""
    transformers = pytest.importorskip("transformers")
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model = None
    for name, path in lora_dirs.items():
        if model is None:
            model = peft.PeftModel.from_pretrained(base.eval(), path, adapter_name=name)
        else:
            model.load_adapter(path, adapter_name=name)
    cache: dict[tuple, list[int]] = {}

    def greedy(prompt: list[int], adapter: str | None) -> list[int]:
        key = (tuple(prompt), adapter)
        if key not in cache:
            kw = dict(
                max_new_tokens=MAX_NEW,
                min_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=list(EOS),
                pad_token_id=0,
            )
            with torch.no_grad():
                if adapter is None:
                    with model.disable_adapter():
                        out = model.generate(input_ids=torch.tensor([prompt]), **kw)
                else:
                    model.set_adapter(adapter)
                    out = model.generate(input_ids=torch.tensor([prompt]), **kw)
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return greedy


def lora_engine(tiny_dir, lora_dirs, **cfg) -> Engine:
    cfg.setdefault("num_blocks", 256)
    return Engine.from_model_dir(tiny_dir, EngineConfig(lora_adapters=lora_dirs, **cfg))


def params(adapter: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, lora=adapter)


MIX = [None, "a1", "a2", "a3"]


def test_mixed_batch_equals_peft_per_adapter(tiny_dir, lora_dirs, reference) -> None:
    engine = lora_engine(tiny_dir, lora_dirs)
    reqs = [(p, a) for p in PROMPTS for a in MIX]
    results = engine.generate([p for p, _ in reqs], [params(a) for _, a in reqs])
    outs = {}
    for (p, a), res in zip(reqs, results, strict=True):
        outs[(tuple(p), a)] = res.completions[0].token_ids
        assert res.completions[0].token_ids == reference(p, a), a
    # the adapters really change the model: four different continuations of one prompt
    assert len({tuple(outs[(tuple(PROMPTS[0]), a)]) for a in MIX}) == 4
    assert_no_blocks_in_use(engine)


def test_chunked_prefill_preemption_and_slot_shortage_keep_outputs(
    tiny_dir, lora_dirs, reference
) -> None:
    # a small pool (preemption), small steps (chunked prefill) and two slots for three
    # adapters: the third adapter's requests wait for a slot and reload into an evicted one
    engine = lora_engine(
        tiny_dir,
        lora_dirs,
        num_blocks=14,
        max_num_seqs=6,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        max_loras=2,
    )
    reqs = [(p, a) for a in MIX for p in PROMPTS[:2]]
    results = engine.generate([p for p, _ in reqs], [params(a) for _, a in reqs])
    for (p, a), res in zip(reqs, results, strict=True):
        assert res.completions[0].token_ids == reference(p, a), a
    m = engine.metrics()
    assert m.num_preemptions > 0 and m.num_partial_prefills > 0, m
    slots = engine.executor.runner.lora
    assert slots.loads > 2  # an adapter was evicted and another loaded into its slot
    assert len(engine.executor.loaded_loras()) <= 2
    assert_no_blocks_in_use(engine)


def test_one_step_runs_base_and_every_adapter_together(tiny_dir, lora_dirs) -> None:
    engine = lora_engine(tiny_dir, lora_dirs)
    for a in MIX:
        engine.add_request(PROMPTS[0], params(a))
    engine.step()
    assert {r.params.lora for r in engine.scheduler.running} == set(MIX)
    assert sorted(engine.executor.loaded_loras()) == ["a1", "a2", "a3"]
    while engine.has_unfinished_requests():
        engine.step()


def test_slots_evict_the_least_recently_used_adapter_not_in_the_batch(tiny_dir, lora_dirs):
    engine = lora_engine(tiny_dir, lora_dirs, max_loras=2)
    slots = engine.executor.runner.lora
    a1, a2, a3 = (engine.executor.adapter(n) for n in ("a1", "a2", "a3"))
    assert slots.ensure([a1]) == {"a1": 0}
    assert slots.ensure([a2]) == {"a2": 1}
    slots.ensure([a1])  # a1 used again: a2 is now the least recently used
    assert slots.ensure([a3]) == {"a3": 1}
    assert list(slots.slot_of) == ["a1", "a3"]
    assert slots.ensure([a2, a3]) == {"a2": 0, "a3": 1}  # a1 goes, a3 (in the batch) stays
    assert slots.loads == 4
    with pytest.raises(ValueError, match="max_loras=2"):
        slots.ensure([a1, a2, a3])


def test_slot_limit_holds_every_step(tiny_dir, lora_dirs) -> None:
    engine = lora_engine(tiny_dir, lora_dirs, max_loras=1)
    for a in MIX:
        engine.add_request(PROMPTS[0], params(a))
    while engine.has_unfinished_requests():
        engine.step()
        running = {r.params.lora for r in engine.scheduler.running} - {None}
        assert len(running) <= 1, running
    assert_no_blocks_in_use(engine)


def test_prefix_cache_never_crosses_adapters(tiny_dir, lora_dirs, reference) -> None:
    engine = lora_engine(tiny_dir, lora_dirs)
    prompt = PROMPTS[1]  # 69 tokens: 4 full blocks
    cached = {}
    for a in MIX:  # same prompt, each adapter (and the base) in turn: nothing to share
        res = engine.generate([prompt], params(a))[0]
        cached[a] = res.usage.cached_tokens
        assert res.completions[0].token_ids == reference(prompt, a)
    assert cached == dict.fromkeys(MIX, 0)
    for a in MIX:  # within an adapter: its own earlier KV is a hit, and the output holds
        res = engine.generate([prompt], params(a))[0]
        assert res.usage.cached_tokens == 64, a
        assert res.completions[0].token_ids == reference(prompt, a)
    assert_no_blocks_in_use(engine)


def test_unknown_adapter_is_invalid_and_names_it(tiny_dir, lora_dirs) -> None:
    engine = lora_engine(tiny_dir, lora_dirs)
    with pytest.raises(InvalidRequest, match="nope.*unknown adapter.*a1, a2, a3"):
        engine.add_request(PROMPTS[0], params("nope"))
    assert not engine.has_unfinished_requests()


def test_slot_memory_matches_the_formula(tiny_dir, lora_dirs) -> None:
    from worker.model.lora_slots import slot_bytes

    engine = lora_engine(tiny_dir, lora_dirs, max_loras=3, max_lora_rank=16)
    slots = engine.executor.runner.lora
    assert slots.bytes_per_slot == slot_bytes(engine.executor.runner.config, 16, 4)
    allocated = sum(
        t.numel() * t.element_size()
        for layer in slots.weights
        for a, bs in layer.values()
        for t in (a, *bs)
    )
    assert allocated == 3 * slots.bytes_per_slot


def test_runtime_registration_and_stable_ids(tiny_dir, lora_dirs, tmp_path) -> None:
    engine = lora_engine(tiny_dir, {})
    assert engine.loras == {}
    first = engine.add_lora("a1", lora_dirs["a1"])
    assert first.startswith("a1@") and lora_dirs["a1"] not in first
    copy = tmp_path / "copy"  # the same adapter from another folder: the same id
    copy.mkdir()
    for f in Path(lora_dirs["a1"]).iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    other = lora_engine(tiny_dir, {"a1": str(copy)})
    assert other.loras["a1"] == first
    assert engine.add_lora("a1", str(copy)) == first  # re-registering the same: a no-op
    with pytest.raises(LoraError, match="a1.*other weights"):
        engine.add_lora("a1", lora_dirs["a2"])
    assert engine.generate([PROMPTS[0]], params("a1"))[0].completions[0].token_ids


def test_adapters_registered_for_tenants_report_their_owners(tiny_dir, lora_dirs) -> None:
    engine = lora_engine(
        tiny_dir,
        {"a1": lora_dirs["a1"], "a2": lora_dirs["a2"]},
        lora_tenants={"a1": ["bob", "alice", "bob"]},
    )
    a1, a2 = engine.loras["a1"], engine.loras["a2"]
    assert engine.snapshot().lora_owners == (f"{a1}=alice", f"{a1}=bob")  # a2: every tenant
    a3 = engine.add_lora("a3", lora_dirs["a3"], ["carol"])
    assert engine.snapshot().lora_owners == (f"{a1}=alice", f"{a1}=bob", f"{a3}=carol")
    engine.add_lora("a1", lora_dirs["a1"])  # registered again for every tenant
    assert engine.snapshot().lora_owners == (f"{a3}=carol",)
    for bad in ([], "alice", [""], [3]):
        with pytest.raises(ValueError, match=r"'a2': tenants=.* non-empty list of tenant names"):
            engine.add_lora("a2", lora_dirs["a2"], bad)
    assert engine.snapshot().lora_owners == (f"{a3}=carol",) and engine.loras["a2"] == a2
    with pytest.raises(ValueError, match="lora_tenants names adapter 'zz'.*not in lora_adapters"):
        EngineConfig(lora_adapters={"a1": "x"}, lora_tenants={"zz": ["alice"]})


def test_bad_adapters_are_rejected_with_the_reason(tiny_dir, lora_dirs, tmp_path) -> None:
    engine = lora_engine(tiny_dir, {}, max_lora_rank=8)
    with pytest.raises(LoraError, match="r=16.*max_lora_rank=8"):
        engine.add_lora("big", lora_dirs["a3"])
    with pytest.raises(LoraError, match="adapter_config.json"):
        engine.add_lora("missing", str(tmp_path))
    with pytest.raises(LoraError, match="name"):
        engine.add_lora("bad/name", lora_dirs["a1"])
    bad = build_tiny_lora(tmp_path / "dora", tiny_dir, rank=4)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoraError, match="use_dora"):
        engine.add_lora("dora", str(bad))
    wrong = build_tiny_lora(tmp_path / "wrong", tiny_dir, rank=4)  # then one tensor reshaped
    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.zeros(8, 4)
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="q_proj has A .* this model needs A"):
        engine.add_lora("wrong", str(wrong))
    assert engine.loras == {}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mixed_batch_on_cuda_with_graphs_equals_peft(tiny_dir, lora_dirs, reference) -> None:
    # decode batches without adapters replay CUDA graphs; batches with one run eagerly
    engine = lora_engine(tiny_dir, lora_dirs, device="cuda", cuda_graphs=True)
    reqs = [(p, a) for p in PROMPTS for a in MIX]
    results = engine.generate([p for p, _ in reqs], [params(a) for _, a in reqs])
    for (p, a), res in zip(reqs, results, strict=True):
        assert res.completions[0].token_ids == reference(p, a), a
    assert_no_blocks_in_use(engine)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms
def test_other_families_equal_peft(family, tmp_path) -> None:
    from worker.model.build_tiny import build_tiny_model

    transformers = pytest.importorskip("transformers")
    model_dir = build_tiny_model(tmp_path / family, family, "tiny")
    adapter = str(build_tiny_lora(tmp_path / "a", model_dir, rank=8, seed=4))
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(base.eval(), adapter)
    engine = Engine.from_model_dir(
        model_dir, EngineConfig(num_blocks=64, lora_adapters={"a": adapter})
    )
    prompt = PROMPTS[0]
    got = engine.generate([prompt, prompt], [params(None), params("a")])
    kw = dict(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want_lora = ref.generate(input_ids=torch.tensor([prompt]), **kw)[0, len(prompt) :]
        with ref.disable_adapter():
            want_base = ref.generate(input_ids=torch.tensor([prompt]), **kw)[0, len(prompt) :]
    assert got[0].completions[0].token_ids == want_base.tolist()
    assert got[1].completions[0].token_ids == want_lora.tolist()
    assert want_lora.tolist() != want_base.tolist()
