"""peft's older pickle format (``adapter_model.bin``, ``save_pretrained(safe_serialization=
False)``): served as its safetensors twin and as peft runs it, unpickled with
``weights_only=True`` so that no payload ever runs, and held to the same checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.test_lora_configs import assert_serves_as_peft
from worker.model.build_tiny_lora import build_tiny_lora
from worker.model.config import ModelConfig
from worker.model.lora import PICKLE_WEIGHTS_FILE, WEIGHTS_FILE, LoraError, load_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def peft_twins(tmp_path: Path, model_dir: Path) -> tuple[Path, Path]:
    """One peft adapter (random B) saved twice: as safetensors and as peft's pickle."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    torch.manual_seed(3)  # peft draws A from the global generator: the same adapter each run
    model = peft.get_peft_model(base, lora)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1])
    model.save_pretrained(tmp_path / "st")
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    return tmp_path / "st", tmp_path / "bin"


def _load(folder: Path, model_dir: Path):
    return load_adapter("a", folder, ModelConfig.from_dir(model_dir), max_rank=16)


def test_peft_bin_adapter_equals_its_safetensors_twin_and_peft(tiny_dir, tmp_path) -> None:
    st, pickled = peft_twins(tmp_path, tiny_dir)
    assert sorted(p.name for p in pickled.iterdir()) == [
        "README.md",
        "adapter_config.json",
        PICKLE_WEIGHTS_FILE,
    ]
    ours, twin = _load(pickled, tiny_dir), _load(st, tiny_dir)
    assert ours.weights.keys() == twin.weights.keys() and len(ours.weights) == 3 * 2
    for key, (a, b) in twin.weights.items():
        assert torch.equal(ours.weights[key][0], a) and torch.equal(ours.weights[key][1], b)
    assert_serves_as_peft(tiny_dir, pickled)  # peft reads the .bin itself


def test_safetensors_wins_when_both_files_are_there(tiny_dir, tmp_path) -> None:
    st, pickled = peft_twins(tmp_path, tiny_dir)
    want = _load(st, tiny_dir)
    (st / PICKLE_WEIGHTS_FILE).write_bytes(b"not read: the safetensors file is")
    got = _load(st, tiny_dir)
    assert got.adapter_id == want.adapter_id  # digest of the same (safetensors) file
    (pickled / WEIGHTS_FILE).write_bytes(b"read first, so refused")
    with pytest.raises(LoraError, match=r"adapter_model\.safetensors is not a readable"):
        _load(pickled, tiny_dir)


class _Payload:
    """Unpickling this creates ``marker``: what an unsafe ``torch.load`` would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickled_payload_is_refused_and_never_runs(tiny_dir, tmp_path) -> None:
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4)
    (a / WEIGHTS_FILE).unlink()
    marker = tmp_path / "ran"
    torch.save({KEY: _Payload(marker)}, a / PICKLE_WEIGHTS_FILE)
    with pytest.raises(
        LoraError,
        match=r"'a'.*adapter_model\.bin is not a PyTorch weights file that can be "
        r"loaded safely.*Unsupported global: GLOBAL (io|builtins)\.open",
    ):
        _load(a, tiny_dir)
    assert not marker.exists()
    torch.load(a / PICKLE_WEIGHTS_FILE, weights_only=False)  # the payload is live
    assert marker.exists()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({KEY: [1.0, 2.0]}, rf"entry '{KEY}' is a list, not a tensor"),
        ({KEY: torch.zeros(4, 256, dtype=torch.int64)}, rf"tensor '{KEY}' has dtype torch.int64"),
        ({KEY: torch.full((4, 256), float("nan"))}, rf"'{KEY}' holds NaN or infinite values"),
        ([torch.zeros(2)], r"holds a list, not a dict of tensors"),
        ({"lm_head.lora_A.weight": torch.zeros(4, 256)}, r"is not a LoRA weight of"),
    ],
)
def test_bin_adapter_gets_the_safetensors_checks(tiny_dir, tmp_path, payload, message) -> None:
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4)
    (a / WEIGHTS_FILE).unlink()
    torch.save(payload, a / PICKLE_WEIGHTS_FILE)
    with pytest.raises(LoraError, match=r"adapter 'a': .*adapter_model\.bin.*" + message):
        _load(a, tiny_dir)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated zip", b"\x80\x02 junk"])
def test_unreadable_bin_is_refused(tiny_dir, tmp_path, content) -> None:
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4)
    (a / WEIGHTS_FILE).unlink()
    (a / PICKLE_WEIGHTS_FILE).write_bytes(content)
    with pytest.raises(LoraError, match=r"'a': .*adapter_model\.bin (is empty|is not a PyTorch)"):
        _load(a, tiny_dir)


def test_a_folder_without_weights_names_both_files(tiny_dir, tmp_path) -> None:
    a = build_tiny_lora(tmp_path / "a", tiny_dir, rank=4)
    (a / WEIGHTS_FILE).unlink()
    with pytest.raises(LoraError, match=r"adapter_model\.safetensors or adapter_model\.bin"):
        _load(a, tiny_dir)
