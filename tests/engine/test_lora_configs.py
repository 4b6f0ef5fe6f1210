"""Adapter configs as peft writes them: served exactly as peft runs them, or refused by name.

The adapters are made by ``peft`` itself (``get_peft_model`` + ``save_pretrained``) on the
tiny Llama, with random B (peft initialises B to zero); engine and peft then score the same
tokens and must agree on every logprob.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.engine import Engine, EngineConfig, SamplingParams
from worker.model.build_tiny_lora import build_tiny_lora
from worker.model.lora import LoraError

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPT = [7, 93, 41, 250, 18, 301, 77, 5, 140, 66, 12, 480]
NEW = 6


def peft_adapter(out: Path, model_dir: Path, seed: int = 0, **lora: object) -> Path:
    """An adapter saved by peft for ``LoraConfig(**lora)``, B drawn at random."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)  # peft draws A from the global generator: the same adapter each run
    model = peft.get_peft_model(base, peft.LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1])
    model.save_pretrained(out)
    return out


def edit_config(folder: Path, **changes: object) -> Path:
    """Set keys of the adapter's config (a value of ``...`` deletes the key)."""
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))
    return folder


def peft_logprobs(model_dir: Path, adapter: Path, tokens: list[int]) -> torch.Tensor:
    """log-softmax at every position of ``tokens`` under base + adapter, as peft runs it."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base.eval(), str(adapter))
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].log_softmax(-1)


def assert_serves_as_peft(model_dir: Path, adapter: Path) -> None:
    engine = Engine.from_model_dir(
        model_dir, EngineConfig(num_blocks=32, lora_adapters={"x": str(adapter)})
    )
    p = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=3, lora="x")
    comp = engine.generate([PROMPT], p)[0].completions[0]
    base = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=3)
    want = peft_logprobs(model_dir, adapter, PROMPT + comp.token_ids)
    assert comp.logprobs is not None
    for i, lp in enumerate(comp.logprobs):
        row = want[len(PROMPT) - 1 + i]
        assert lp.token_id == int(row.argmax()), i  # greedy under peft too
        top_v, top_i = row.topk(3)
        assert [t for t, _ in lp.top] == top_i.tolist(), i
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=2e-4), i
    # and the adapter matters: the base model picks or scores the first token otherwise
    first = engine.generate([PROMPT], base)[0].completions[0].logprobs[0]
    lora_first = comp.logprobs[0]
    assert first.token_id != lora_first.token_id or first.logprob != pytest.approx(
        lora_first.logprob, abs=1e-2
    )


# ---- honoured: target matching, exclusions, layer indices, peft's defaults ----------------


def test_all_linear_with_a_full_path_exclusion_equals_peft(tiny_dir, tmp_path) -> None:
    # peft saves "all-linear" expanded to full module paths, the exclusion as given
    a = peft_adapter(
        tmp_path / "a",
        tiny_dir,
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        exclude_modules=["model.layers.0.self_attn.q_proj"],
    )
    saved = json.loads((a / "adapter_config.json").read_text())
    assert "model.layers.1.mlp.down_proj" in saved["target_modules"]
    assert not any(
        "layers.0.self_attn.q_proj" in k for k in load_file(a / "adapter_model.safetensors")
    )
    assert_serves_as_peft(tiny_dir, a)


def test_all_linear_as_written_and_a_regex_exclusion_equal_peft(tiny_dir, tmp_path) -> None:
    a = peft_adapter(tmp_path / "a", tiny_dir, r=4, target_modules="all-linear")
    # the shorthand itself and a regex exclusion (peft resolves both when loading)
    edit_config(a, target_modules="all-linear", exclude_modules=r".*\.1\.mlp\.(up|down)_proj")
    tensors = load_file(a / "adapter_model.safetensors")
    kept = {
        k: v for k, v in tensors.items() if not ("layers.1.mlp.up" in k or "layers.1.mlp.down" in k)
    }
    save_file(kept, a / "adapter_model.safetensors")
    assert_serves_as_peft(tiny_dir, a)


def test_regex_target_equals_peft(tiny_dir, tmp_path) -> None:
    a = peft_adapter(tmp_path / "a", tiny_dir, r=4, target_modules=r".*\.(q|v|gate)_proj")
    assert_serves_as_peft(tiny_dir, a)


def test_layers_to_transform_and_pattern_equal_peft(tiny_dir, tmp_path) -> None:
    a = peft_adapter(
        tmp_path / "a",
        tiny_dir,
        r=4,
        target_modules=["q_proj", "down_proj"],
        layers_to_transform=[1],
        layers_pattern="layers",
    )
    assert_serves_as_peft(tiny_dir, a)


def test_weights_outside_the_configured_layers_are_refused(tiny_dir, tmp_path) -> None:
    # peft would ignore them; a file that contradicts its config is refused, naming the key
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4, targets=("q_proj",))
    edit_config(a, layers_to_transform=[1])
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    with pytest.raises(LoraError, match=r"'x'.*layers\.0\.self_attn\.q_proj.*do not select"):
        engine.add_lora("x", str(a))


def test_missing_lora_alpha_is_peft_default_8_not_r(tiny_dir, tmp_path) -> None:
    a = peft_adapter(
        tmp_path / "a", tiny_dir, r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"]
    )
    edit_config(a, lora_alpha=...)  # peft reads 8: scaling 2, not 1
    assert_serves_as_peft(tiny_dir, a)
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    engine.add_lora("x", str(a))
    assert engine.executor.adapter("x").scaling == 2.0


# ---- refused, naming the key ---------------------------------------------------------------

REFUSED = {  # config change -> what the error must say
    "alora": (dict(alora_invocation_tokens=[5, 6]), r"alora_invocation_tokens=\[5, 6\]"),
    "unknown": (dict(frobnicate=1), r"unknown key.*frobnicate"),
    "ia3": (dict(peft_type="IA3"), r"peft_type='IA3'.*only 'LORA'"),
    "dora": (dict(use_dora=True), r"use_dora=True"),
    "pissa": (dict(init_lora_weights="pissa"), r"init_lora_weights='pissa'"),
    "rank_pattern": (dict(rank_pattern={"q_proj": 2}), r"rank_pattern="),
    "lora_bias": (dict(lora_bias=True), r"lora_bias=True"),
    "seq_cls": (dict(task_type="SEQ_CLS"), r"task_type='SEQ_CLS'"),
    "embedding": (dict(target_modules=["q_proj", "embed_tokens"]), r"model\.embed_tokens"),
    "lm_head": (dict(target_modules=["q_proj", "lm_head"]), r"selects \['lm_head'\]"),
    "bad_exclude": (dict(exclude_modules=5), r"exclude_modules=5 must be a list"),
    "str_alpha": (dict(lora_alpha="x"), r"lora_alpha='x' must be a number"),
    "nan_alpha": (dict(lora_alpha=math.nan), r"lora_alpha=nan must be a finite number"),
    "inf_alpha": (dict(lora_alpha=math.inf), r"lora_alpha=inf must be a finite number"),
    "huge_alpha": (dict(lora_alpha=1e38), r"lora_alpha=1e\+38 .* can grow an input of size 1"),
    "regex_layers": (
        dict(target_modules=".*q_proj", layers_to_transform=[0]),
        r"layers_to_transform / layers_pattern cannot be used",
    ),
    "nothing": (dict(target_modules=["nope_proj"]), r"selects no projection"),
    "pattern_alone": (dict(layers_pattern="layers"), r"layers_pattern='layers' needs layers_to"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_settings_are_refused_naming_adapter_file_and_key(
    case, tiny_dir, tmp_path
) -> None:
    change, message = REFUSED[case]
    a = edit_config(
        build_tiny_lora(tmp_path / "a", tiny_dir, rank=4, targets=("q_proj",)), **change
    )
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    with pytest.raises(LoraError) as info:
        engine.add_lora("bad", str(a))
    text = str(info.value)
    assert "'bad'" in text, text
    if case != "huge_alpha":
        assert str(a / "adapter_config.json") in text, text
    assert re.search(message, text), text
    assert engine.loras == {}


def test_peft_defaults_of_every_key_are_accepted(tiny_dir, tmp_path) -> None:
    # a config with every key peft writes, at its defaults: nothing refused
    a = peft_adapter(tmp_path / "a", tiny_dir, r=4, target_modules=["q_proj"])
    saved = json.loads((a / "adapter_config.json").read_text())
    assert {"alora_invocation_tokens", "use_dora", "megatron_config", "loftq_config"} <= set(saved)
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    assert engine.add_lora("ok", str(a)).startswith("ok@")


def test_an_early_peft_config_is_served(tiny_dir, tmp_path) -> None:
    # the keys of peft 0.2 (enable_lora, merge_weights), which today's peft drops
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4, targets=("q_proj", "v_proj"))
    edit_config(a, enable_lora=None, merge_weights=False)
    assert_serves_as_peft(tiny_dir, a)
    edit_config(a, enable_lora=[True, False, True])
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    with pytest.raises(LoraError, match=r"enable_lora=\[True, False, True\] is not supported"):
        engine.add_lora("old", str(a))


def test_config_that_is_not_an_object_names_adapter_and_file(tiny_dir, tmp_path) -> None:
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4)
    (a / "adapter_config.json").write_text("[1, 2]")
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    with pytest.raises(LoraError, match=r"'arr'.*adapter_config\.json.*JSON object, not list"):
        engine.add_lora("arr", str(a))


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", r"is empty"),
        (b"\x00garbage that is no safetensors header", r"not a readable safetensors file"),
    ],
)
def test_unreadable_weights_name_adapter_and_file(content, message, tiny_dir, tmp_path) -> None:
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4)
    (a / "adapter_model.safetensors").write_bytes(content)
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    with pytest.raises(LoraError) as info:
        engine.add_lora("w", str(a))
    assert "'w'" in str(info.value) and "adapter_model.safetensors" in str(info.value)
    assert re.search(message, str(info.value)), info.value


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused(value, tiny_dir, tmp_path) -> None:
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4)
    tensors = load_file(a / "adapter_model.safetensors")
    key = sorted(tensors)[3]
    tensors[key][0, 0] = value
    save_file(tensors, a / "adapter_model.safetensors")
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    with pytest.raises(LoraError, match=rf"'n'.*safetensors.*{key}.*NaN or infinite"):
        engine.add_lora("n", str(a))


def test_a_scaling_that_overflows_half_precision_is_refused(tiny_dir, tmp_path) -> None:
    # fine in float32, but lora_B * scaling is past float16's 65504
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4, alpha=1e6, targets=("q_proj",))
    fp32 = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32))
    assert fp32.add_lora("h", str(a))
    fp16 = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=32, dtype="float16"))
    with pytest.raises(LoraError, match=r"'h'.*torch\.float16"):
        fp16.add_lora("h", str(a))
