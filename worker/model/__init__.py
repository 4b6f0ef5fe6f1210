"""Llama-family models from Hugging Face folders and GGUF files, run over a paged KV cache.

Public API (imported lazily, so ``worker.model.tokenizer`` stays torch-free for the router):

* ``ModelRunner(model_dir, dtype=..., device=..., block_size=..., num_blocks=...,
  kv_memory_bytes=..., attn_backend=...)`` with ``num_blocks``, ``copy_blocks(pairs)``,
  ``build_input(seqs)`` and ``execute(model_input) -> logits``;
* ``ModelInput`` / ``SeqChunk``: the flat step batch and its builder from Python lists;
* ``ModelConfig``: parsed ``config.json``; ``Tokenizer``: encode/decode/chat template;
* ``build_tiny_model(out_dir, family, size, seed)``: random-weight model folder, offline;
* ``default_model_path()``: the default model's GGUF file (SmolLM2-135M-Instruct);
* errors: ``ModelLoadError`` > ``UnsupportedModelError``, ``WeightMismatchError``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelRunner": "worker.model.runner",
    "KVCacheSizeError": "worker.model.runner",
    "ModelInput": "worker.model.inputs",
    "SeqChunk": "worker.model.inputs",
    "ModelConfig": "worker.model.config",
    "SUPPORTED_ARCHITECTURES": "worker.model.config",
    "Tokenizer": "worker.model.tokenizer",
    "build_tiny_model": "worker.model.build_tiny",
    "default_model_path": "worker.model.default_model",
    "ModelLoadError": "worker.model.errors",
    "UnsupportedModelError": "worker.model.errors",
    "WeightMismatchError": "worker.model.errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'worker.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
