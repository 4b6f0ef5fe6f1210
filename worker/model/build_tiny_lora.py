"""Random-weight LoRA adapters in the PEFT folder format, for tests and benchmarks.

Written directly (safetensors + ``adapter_config.json`` as ``peft`` saves them), so building
needs no ``peft``; the tests load the same folders with ``peft`` as the reference.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker.model.config import ModelConfig
from worker.model.lora import CONFIG_FILE, MODULES, WEIGHTS_FILE, _module_dims


def build_tiny_lora(
    out_dir: str | Path,
    model_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = MODULES,
    seed: int = 0,
    strength: float = 1.0,
) -> Path:
    """Write an adapter for the model in ``model_dir`` with random A and B (B is zero in a
    freshly initialised PEFT adapter, which would make it a no-op). ``strength`` scales B:
    1.0 changes a tiny model's greedy output within a few tokens."""
    cfg = ModelConfig.from_dir(model_dir)
    dims = _module_dims(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for mod in targets:
            fan_in, fan_out = dims[mod]
            part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{mod}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) * strength / rank
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out
