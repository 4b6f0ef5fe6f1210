"""The model's tokenizer, loaded from ``tokenizer.json`` with the ``tokenizers`` library.

``tokenizer_config.json`` gives the special tokens (bos/eos/pad) and the chat template (also
read from ``chat_template.jinja``, where newer transformers save it); ``generation_config.json``
may add more end-of-sequence ids. The router and the engine both use this class, so they
tokenize identically.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from worker.model.errors import ModelLoadError


def _token_text(value: Any) -> str | None:
    """Special tokens are stored as plain strings or as AddedToken dicts."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class Tokenizer:
    """encode / decode / chat template of one model folder."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self._tok = backend
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_token_id = self._id(bos_token)
        self.eos_token_id = self._id(eos_token)
        self.pad_token_id = self._id(pad_token)
        self.chat_template = chat_template
        ids = [self.eos_token_id] if self.eos_token_id is not None else []
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*ids, *extra_eos_ids]))
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} not found: a fast tokenizer (tokenizer.json) is required")
        config = _read_json(root / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        gen_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(
            _HFTokenizer.from_file(str(path)),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            pad_token=_token_text(config.get("pad_token")),
            chat_template=template,
            extra_eos_ids=extra,
        )

    def _id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids incl. added tokens."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) to the prompt text.

        The template emits the bos token itself, so encode the result with
        ``add_special_tokens=False`` (as transformers does).
        """
        if self.chat_template is None:
            raise ModelLoadError("this tokenizer has no chat template")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), False)
