"""Build a ``LlamaForCausalLM`` (or a ``Gemma3ForCausalLM``) for a model folder and fill it
from the checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.attention.base import AttentionBackend
from worker.model.config import ModelConfig
from worker.model.gemma3 import Gemma3ForCausalLM
from worker.model.gguf_file import is_gguf
from worker.model.gguf_weights import load_gguf_weights
from worker.model.layers import RotaryEmbedding
from worker.model.llama import LlamaForCausalLM
from worker.model.load_errors import ModelLoadError
from worker.model.weights import load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ModelLoadError(f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}")


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM] | type[Gemma3ForCausalLM]:
    return Gemma3ForCausalLM if cfg.architecture == "Gemma3ForCausalLM" else LlamaForCausalLM


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint of ``cfg`` must hold (no memory used)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg, backend=None)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def load_model(
    model_dir: str | Path,
    backend: AttentionBackend | None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    config: ModelConfig | None = None,
) -> LlamaForCausalLM | Gemma3ForCausalLM:
    """Load weights of ``model_dir`` (a Hugging Face folder or a ``.gguf`` file) into a model
    on ``device`` in ``dtype`` (inference mode)."""
    cfg = config or ModelConfig.from_dir(model_dir)
    torch_dtype = resolve_dtype(dtype)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, backend).to(torch_dtype)
    model.to_empty(device=torch.device(device))
    for module in model.modules():  # float32, recomputed on the target device
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    model.fuse_projections()  # before loading: the checkpoint is copied into the fused storage
    if is_gguf(model_dir):
        load_gguf_weights(model, model_dir, cfg)
    else:
        load_weights(model, model_dir, multimodal=cfg.multimodal is not None)
    return model.eval().requires_grad_(False)
