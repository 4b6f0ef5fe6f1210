"""Build a random-weight Llama-family model folder offline, in the exact Hugging Face format.

    python -m worker.model.build_tiny --out DIR --family llama|mistral|qwen2|qwen3|gemma3 \
        [--size tiny|32m|100m] [--seed N]

The folder holds ``config.json``, ``model.safetensors``, ``generation_config.json`` and a real
byte-level BPE tokenizer trained on an embedded corpus (``tokenizer.json`` and
``tokenizer_config.json`` with special tokens and a chat template). It loads with this
package's runner and with ``transformers``' ``AutoModelForCausalLM`` / ``AutoTokenizer``.

Family traits exercised by the tiny sizes: llama uses Llama-3 rope scaling; mistral a sliding
window; qwen2 QKV bias and tied embeddings; qwen3 q/k RMSNorm and head_dim != hidden/heads;
gemma3 its (1 + weight) sandwich norms, GeGLU, query_pre_attn_scalar != head_dim, scaled and
tied embeddings, 5 sliding, 1 global, 1 sliding layer with two rope bases (linear scaling on
the global one).
Builds are cached: a folder that already holds the same (family, size, seed) is returned as is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.runtime.cache_dir import cache_root
from worker.model.config import ModelConfig
from worker.model.tiny_tokenizer import SPECIAL_TOKENS, train_tokenizer

if TYPE_CHECKING:
    import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
SIZES = {
    # vocab, hidden, intermediate, layers, heads, kv heads, max positions
    "tiny": dict(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv=2, max_pos=2048),
    "32m": dict(vocab=4096, hidden=512, inter=1792, layers=8, heads=8, kv=4, max_pos=4096),
    # Small compute, large vocabulary: host-side costs of a step show as they do next to a GPU.
    "light": dict(vocab=8192, hidden=256, inter=1024, layers=2, heads=4, kv=2, max_pos=2048),
    "100m": dict(vocab=4096, hidden=768, inter=2560, layers=12, heads=12, kv=4, max_pos=4096),
    # The GPU benchmark's model (benchmarks/gpu_engine.py): Llama shapes at ~853M parameters.
    "853m": dict(vocab=32000, hidden=2048, inter=5632, layers=16, heads=32, kv=8, max_pos=8192),
}
_MARKER = ".kvcluster-tiny.json"
_BUILDER_VERSION = 1  # bump when the output of a (family, size, seed) changes


def default_dir(family: str, size: str, seed: int) -> Path:
    return cache_root() / "models" / f"tiny-{family}-{size}-s{seed}"


def model_config(family: str, size: str, ids: dict[str, int]) -> dict[str, Any]:
    """config.json content, in the layout of the Hugging Face Hub checkpoints."""
    s = SIZES[size]
    head_dim = s["hidden"] // s["heads"]
    cfg: dict[str, Any] = {
        "architectures": [
            {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
                "gemma3": "Gemma3ForCausalLM",
            }[family]
        ],
        "model_type": family,
        "vocab_size": s["vocab"],
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s["max_pos"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32" if size == "tiny" else "bfloat16",
    }
    if family == "llama":
        cfg["rope_theta"] = 500000.0
        cfg["mlp_bias"] = False
        # Small original context so that all three llama3 regimes occur at tiny head_dim.
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64 if size == "tiny" else 1024,
        }
    elif family == "mistral":
        cfg["sliding_window"] = 24 if size == "tiny" else None
    elif family == "gemma3":
        del cfg["hidden_act"]  # Gemma 3 names it hidden_activation
        cfg.update(_gemma3_traits(size, 7 if size == "tiny" else s["layers"]))
    else:
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=s["layers"])
        if family == "qwen2":
            cfg["tie_word_embeddings"] = True
        else:
            cfg["head_dim"] = 2 * head_dim  # Qwen3 decouples head_dim from hidden/heads
    return cfg


def _gemma3_traits(size: str, layers: int) -> dict[str, Any]:
    """Gemma 3's keys as its Hub checkpoints write them (``model_type: gemma3_text``)."""
    tiny = size == "tiny"
    pattern = 6  # five sliding-window layers, then a global one (tiny: 7 layers, s5 g s)
    return {
        "model_type": "gemma3_text",
        "num_hidden_layers": layers,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 24 if tiny else 256,  # != head_dim: the scaling shows
        "sliding_window": 12 if tiny else 512,
        "layer_types": [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ],
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},  # global layers only
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Deterministic random tensors for every name the architecture expects."""
    # torch and the loader load here, not at the top: finding a model already built (every
    # router of a tiny-model cluster does) must not cost a process torch's import
    import torch

    from worker.model.loader import tensor_shapes

    gen = torch.Generator().manual_seed(seed)
    std = 0.8 / cfg.hidden_size**0.5  # large enough for clear argmax margins in greedy tests
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        noise = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):  # Gemma stores norm weights as offsets from 1
            tensor = 0.1 * noise + (cfg.architecture != "Gemma3ForCausalLM")
        else:
            tensor = (std * noise) if name.endswith("weight") else 0.1 * noise
        out[name] = tensor.to(dtype).contiguous()
    return out


def _write_folder(out: Path, family: str, size: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    bos = family in ("llama", "mistral", "gemma3")  # Qwen tokenizers add no bos token
    tok = train_tokenizer(SIZES[size]["vocab"], add_bos=bos)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    raw = model_config(family, size, ids)
    cfg = ModelConfig.from_dict(raw)
    dtype = torch.float32 if raw["torch_dtype"] == "float32" else torch.bfloat16
    save_file(
        random_weights(cfg, seed, dtype), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    gen = {
        "bos_token_id": ids["<s>"],
        "eos_token_id": [ids["</s>"], ids["<|im_end|>"]],
        "pad_token_id": ids["<pad>"],
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>" if bos else None,
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": raw["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": GEMMA3_CHAT_TEMPLATE if family == "gemma3" else CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and bos_token %}{{ bos_token }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Gemma 3's own template (its Hub tokenizer_config.json): a system turn is folded into the
# first user turn, roles must alternate, the assistant speaks as "model".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def build_tiny_model(
    out_dir: str | Path | None = None, family: str = "llama", size: str = "tiny", seed: int = 0
) -> Path:
    """Build (or reuse) a random-weight model folder and return its path.

    ``out_dir`` defaults to ``$KVCLUSTER_CACHE`` or ``~/.cache/kvcluster``, under
    ``models/tiny-{family}-{size}-s{seed}``. Concurrent callers are safe: the folder is built
    aside and renamed into place.
    """
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not one of {', '.join(SIZES)}")
    out = Path(out_dir) if out_dir is not None else default_dir(family, size, seed)
    stamp = {"family": family, "size": size, "seed": seed, "version": _BUILDER_VERSION}
    if _stamp(out) == stamp:
        return out
    if out.exists() and any(out.iterdir()) and _stamp(out) is None:
        raise FileExistsError(f"{out} exists and is not a tiny-model build; refusing to overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_folder(tmp, family, size, seed)
        (tmp / _MARKER).write_text(json.dumps(stamp))
        if out.exists():
            if _stamp(out) == stamp:  # another process finished first
                return out
            shutil.rmtree(out)  # empty, or a stale build of other parameters
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _stamp(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / _MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to create (reused if up to date)")
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out, args.family, args.size, args.seed)
    print(path)


if __name__ == "__main__":
    main()
