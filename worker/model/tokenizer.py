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

from worker.model.chat_tools import with_tools
from worker.model.load_errors import ModelLoadError


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


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# what a chat message may carry to the template: tool calls and results with their ids, the
# author's name, an assistant turn's reasoning (which reasoning models' templates read)
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
MAX_CHAT_MESSAGES = 1024  # more turns than any context window holds
# End-of-turn markers of common chat templates, searched in this order (ChatML first).
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate a chat: a non-empty list of {role, content} with known roles and non-empty
    content. Returns plain dicts (what the template sees); raises ValueError naming the
    message index, the field and the value."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(
            f"messages must be a list of {{role, content}}, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise ValueError(f"messages has {len(messages)} entries, limit {MAX_CHAT_MESSAGES}")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a mapping with role and content")
        role, content = msg.get("role"), msg.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role={role!r} is not one of {', '.join(CHAT_ROLES)}")
        calls = msg.get("tool_calls") if role == "assistant" else None
        if not isinstance(content, str) or not (content.strip() or calls):
            raise ValueError(f"messages[{i}].content is empty (role {role!r})")
        out.append({k: msg[k] for k in MESSAGE_KEYS if k in msg})
    return out


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
        # The token the chat template closes each turn with; generation stops there by
        # default (a ChatML model's eos may be <|endoftext|>, which an answer never emits).
        self.end_of_turn_token = next(
            (
                t
                for t in _END_OF_TURN_TOKENS
                if chat_template and t in chat_template and backend.token_to_id(t) is not None
            ),
            None,
        )
        self.end_of_turn_token_id = self._id(self.end_of_turn_token)
        ids = [i for i in (self.eos_token_id, self.end_of_turn_token_id) if i is not None]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*ids, *extra_eos_ids]))
        self._template: jinja2.Template | None = None

    def save(self, out_dir: str | Path) -> Path:
        """Write this tokenizer as a Hugging Face folder (``tokenizer.json`` and
        ``tokenizer_config.json`` with its special tokens and chat template), which
        ``transformers.AutoTokenizer`` and clients such as ``vllm bench serve`` load, whatever
        the model was loaded from (a folder or a GGUF file)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "chat_template": self.chat_template,
        }
        text = json.dumps({k: v for k, v in config.items() if v is not None}, indent=2)
        (out / "tokenizer_config.json").write_text(text)
        return out

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """From a Hugging Face folder, or from a ``.gguf`` file."""
        if str(model_dir).lower().endswith(".gguf"):
            return cls.from_gguf(model_dir)
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

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer and chat template stored in a GGUF file's metadata."""
        from worker.model.gguf_tokenizer import tokenizer_backend_from_gguf

        backend, special = tokenizer_backend_from_gguf(path)
        return cls(backend, **special)

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
        ids = ids if isinstance(ids, list) else list(ids)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens: ``decode(..., skip_special_tokens=True)`` drops
        them before decoding, so they never change a decoded text (the detokenizer skips
        its work for them)."""
        special = getattr(self, "_special_ids", None)
        if special is None:
            added = self._tok.get_added_tokens_decoder()
            special = self._special_ids = frozenset(i for i, t in added.items() if t.special)
        return special

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def backend_json(self) -> str:
        """The ``tokenizers`` model as JSON (what grammar libraries read the vocabulary from)."""
        return self._tok.to_str()

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) to the prompt text with the
        model's chat template in a sandboxed Jinja environment (as transformers does).

        ``continue_final_message``: the text ends inside the last message (its end-of-turn
        cut), so the model continues it. ``template_kwargs``: extra template variables (such
        as Qwen3's ``enable_thinking``); they cannot replace the ones set here. A
        ``developer`` message (OpenAI's newer name for system) is rendered as ``system`` by a
        template that does not mention that role.

        Raises ValueError for a model without a template, an unknown role or empty content.
        The template emits the bos token itself, so encode the result with
        ``add_special_tokens=False`` (as transformers does).
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain text prompt")
        checked, tools = with_tools(check_messages(messages), tools, self.chat_template)
        if "developer" not in self.chat_template:
            for m in checked:
                if m["role"] == "developer":
                    m["role"] = "system"
        if continue_final_message and checked[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_template_error
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise ValueError(f"chat template does not compile: {exc}") from exc
        try:
            text = self._template.render(
                {
                    **dict(template_kwargs or {}),
                    "messages": checked,
                    "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": self.bos_token or "",
                    "eos_token": self.eos_token or "",
                }
            )
        except jinja2.TemplateError as exc:  # incl. the sandbox refusing an unsafe access
            raise ValueError(f"chat template failed: {exc}") from exc
        if continue_final_message:  # as transformers does: cut after the last content
            last = checked[-1]["content"].rstrip()
            cut = text.rfind(last)
            if cut < 0:
                raise ValueError("continue_final_message: the template rewrote the last message")
            text = text[: cut + len(last)]
        return text

    apply_chat_template = render_chat  # the transformers name

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
            tools=tools,
        )
        return self.encode(text, False)
