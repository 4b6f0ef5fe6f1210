"""A tiny reasoning model for tests: the tiny random Qwen3 with ``<think>`` and ``</think>`` as
single, non-special tokens (as Qwen3's and DeepSeek-R1's vocabularies have them) and a
Qwen3-like chat template.

The template honours ``enable_thinking`` as Qwen3's does (false: the generation prompt ends
with an empty, closed reasoning, ``<think>\\n\\n</think>\\n\\n``; true or unset: it ends at
``<|im_start|>assistant\\n`` and the model may open the reasoning itself) and, for a
DeepSeek-R1-like prompt, ``open_thinking`` (true: the generation prompt ends with
``<think>\\n``, the reasoning opened for the model).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from worker.model.build_tiny import build_tiny_model
from worker.model.reasoning_markers import END, START

THINKING_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if open_thinking is defined and open_thinking %}"
    "{{- '<think>\\n' }}"
    "{%- elif enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# an added token's flags, as tokenizer.json spells them: matched as is, kept by decode
_PLAIN = dict(single_word=False, lstrip=False, rstrip=False, normalized=False, special=False)
_built: dict[str, Path] = {}  # per process: the folder made by the first call


def thinking_model(where: Any = None) -> Path:
    """The reasoning model's folder, made once per process under ``where`` (a folder, or
    pytest's ``tmp_path_factory``; None: a temporary folder)."""
    made = _built.get("model")
    if made is not None and made.is_dir():
        return made
    if where is None:
        base = Path(tempfile.mkdtemp(prefix="thinking-model-"))
    elif hasattr(where, "mktemp"):
        base = Path(where.mktemp("thinking-model"))
    else:
        base = Path(where)
    out = base / "tiny-qwen3-thinking"
    shutil.copytree(build_tiny_model(family="qwen3"), out, dirs_exist_ok=True)
    (out / ".kvcluster-tiny.json").unlink(missing_ok=True)  # not the builder's any more
    path = out / "tokenizer.json"
    path.write_text(json.dumps(with_markers(json.loads(path.read_text()))))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    _built["model"] = out
    return out


def with_markers(tok: dict[str, Any]) -> dict[str, Any]:
    """``tok`` (a ``tokenizer.json``) with its last two ids turned into ``<think>`` and
    ``</think>``, same ids, not special. A reserved added token (``<|reserved_N|>``) is
    renamed; an id the BPE learnt (a vocabulary the corpus fills, as the tiny one) leaves the
    model's vocabulary with the merge that made it (the last merges: no later merge uses
    them) and comes back as an added token."""
    model = tok["model"]
    vocab: dict[str, int] = model["vocab"]
    added = {a["id"]: a for a in tok["added_tokens"]}
    last = max([*vocab.values(), *added])
    names = {i: name for name, i in vocab.items()}
    new = []
    for token_id, text in ((last, END), (last - 1, START)):  # (the last merge first)
        entry = added.get(token_id)
        if entry is not None:  # a reserved token: renamed (and in the vocabulary, if there)
            assert entry["content"].startswith("<|reserved_"), entry
            vocab.pop(entry["content"], None)
            entry.update(content=text, special=False)
            continue
        name = names[token_id]
        merge = model["merges"].pop()
        pair = merge.split(" ") if isinstance(merge, str) else merge
        assert "".join(pair) == name, (pair, name)  # the id the last merge learnt
        del vocab[name]
        new.append({"id": token_id, "content": text, **_PLAIN})
    # in id order: ``tokenizers`` numbers the added tokens missing from the vocabulary in turn
    tok["added_tokens"] += sorted(new, key=lambda e: e["id"])
    return tok
