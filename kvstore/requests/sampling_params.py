"""Per-request sampling parameters, validated on construction: the one declaration of the
sampling fields.

Every rule violation raises :class:`InvalidRequest` naming the field, the value and the limit,
so the gRPC layer can return ``INVALID_ARGUMENT`` with a message a user can act on. Limits that
depend on the model or the engine (vocabulary size, ``max_num_seqs``) are checked by the engine
in :func:`worker.engine.validate.validate_request`.

Each field also says where it travels (:class:`Wire`, in its metadata; :data:`WIRE` by name):
the gRPC conversion (``router/edge/convert.py``) and the OpenAI field list
(``router/http_api/openai_request.py``) are derived from it, and
``tests/router/test_sampling_wire.py`` fails when a field is on one side and not the other.
Adding a sampling parameter: a field here, its proto field, and (when the HTTP API takes it)
its OpenAI name.
"""

from __future__ import annotations

import math
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal

from kvstore.requests.errors import InvalidRequest
from kvstore.requests.output_constraint import StructuredOutputs
from kvstore.requests.wire import ByName

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (as vLLM does)
MAX_N = 256  # parallel samples / beams of one request
MAX_LOGPROBS = 20  # top alternatives returned per token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 128  # each is checked per generated token (a set) and masked before min_tokens
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 1024  # entries of logit_bias; each is added to its token's logit
MAX_ALLOWED_TOKEN_IDS = 1 << 17  # allowed_token_ids: a vocabulary's worth (the mask is per row)
MAX_BAD_WORDS = 128  # bad_words: each is checked against every sample's output per step
# Beyond this a length penalty only decides by length (len ** 10 dwarfs any log-prob gap);
# scores are ranked in log space, so the bound is for sense, not for overflow.
MAX_LENGTH_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0  # presence / frequency penalties, as OpenAI bounds them
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True, slots=True)
class Wire:
    """Where a sampling field travels on each API."""

    # the GenerateRequest field that sets it ("params.top_k"; a request-level field such as
    # "priority"); None: not on the gRPC API (``note`` says why)
    proto: str | None
    # the OpenAI / vLLM body fields that set it, on both /v1/completions and
    # /v1/chat/completions; (): not on the HTTP API (``note`` says why)
    openai: tuple[str, ...]
    chat: tuple[str, ...] = ()  # names only /v1/chat/completions takes
    note: str = ""  # why a side is missing, or what a name's spelling means


_SAME = "<the field's own name>"
_BEAMS = (
    "beam search is served on the gRPC API (params.beam_width); the HTTP API refuses "
    "vLLM's use_beam_search, length_penalty and early_stopping"
)


def _wire(
    default: Any,
    *,
    proto: str | None = _SAME,
    openai: tuple[str, ...] | str = _SAME,
    chat: tuple[str, ...] = (),
    note: str = "",
) -> Any:
    """A field's default and its :class:`Wire` (by default: ``params.<name>`` on gRPC and
    ``<name>`` in OpenAI bodies)."""
    meta = {"wire": (proto, openai, chat, note)}
    return field(default=default, metadata=meta)


def _wire_of(f: Field) -> Wire:
    proto, openai, chat, note = f.metadata["wire"]
    return Wire(
        proto=f"params.{f.name}" if proto is _SAME else proto,
        openai=(f.name,) if openai is _SAME else tuple(openai),
        chat=chat,
        note=note,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class SamplingParams(ByName):
    """How to turn logits into tokens and when to stop; immutable once validated."""

    # completion tokens per sample, >= 1 (also capped by max_model_len)
    max_tokens: int = _wire(16, chat=("max_completion_tokens",))
    # EOS / stop tokens / stop strings are ignored before this many tokens
    min_tokens: int = _wire(0)
    temperature: float = _wire(1.0)  # 0 = greedy; > 0 divides logits before softmax
    top_k: int | None = _wire(None)  # keep the k most likely tokens; None (or 0 / -1) = all
    top_p: float = _wire(1.0)  # nucleus: smallest set with cumulative probability >= top_p, (0, 1]
    min_p: float = _wire(0.0)  # drop tokens with prob < min_p * max prob, [0, 1]
    presence_penalty: float = _wire(0.0)  # minus this on each already generated token's logit
    frequency_penalty: float = _wire(0.0)  # minus this times each generated token's count
    repetition_penalty: float = _wire(1.0)  # prompt/output tokens: logit / p if > 0 else logit * p
    seed: int | None = _wire(None)  # per-request RNG: same seed -> same output whatever the batch
    n: int = _wire(1)  # parallel samples sharing the prompt's KV blocks (one prefill)
    # > 1 = beam search (deterministic; sampling fields are ignored)
    beam_width: int = _wire(1, openai=(), note=_BEAMS)
    # beam search: score = logprob / generated_len ** length_penalty
    length_penalty: float = _wire(1.0, openai=(), note=_BEAMS)
    # beam search stop rule, as in transformers
    early_stopping: bool | Literal["never"] = _wire(False, openai=(), note=_BEAMS)
    stop: tuple[str, ...] = _wire(())  # stop strings (not included in the text unless asked)
    stop_token_ids: tuple[int, ...] = _wire(())  # extra token ids that end a sample
    ignore_eos: bool = _wire(False)  # keep generating past EOS
    include_stop_str_in_output: bool = _wire(False)  # keep the matched stop string in the text
    # None = no logprobs; k >= 0: sampled token + top-k alternatives (chat: logprobs=true
    # with top_logprobs=k)
    logprobs: int | None = _wire(None, chat=("top_logprobs",))
    # None = none; k >= 0: each prompt token's logprob and its top-k alternatives (the
    # prompt is then computed whole: a prefix cache hit would skip positions)
    prompt_logprobs: int | None = _wire(None)
    priority: int = _wire(0, proto="priority")  # smaller = more important; ties go by arrival
    # tenant salt: requests with different salts share no KV (the edges fold the tenant in)
    cache_salt: str | None = _wire(None, proto="cache_salt")
    skip_special_tokens: bool = _wire(True)  # drop special tokens from the text
    # LoRA adapter name (None: the base model); the worker checks it. OpenAI's ``model``
    # names an adapter the same way
    lora: str | None = _wire(None, proto="lora", openai=("model",))
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias:
    # -100 all but bans a token, 100 all but forces it); token ids are checked per model
    logit_bias: tuple[tuple[int, float], ...] = _wire(())
    # vLLM's allowed_token_ids: only these ids may be sampled (after logit_bias, as a mask;
    # empty: every id); token ids are checked per model
    allowed_token_ids: tuple[int, ...] = _wire(())
    # vLLM's bad_words: never generated (as a word or, with a leading space, inside text);
    # the engine tokenizes each, and bans a word's last token where its others end the output
    bad_words: tuple[str, ...] = _wire(())
    # grammar the output must follow (JSON schema, regex, choice, ...); None: free text
    structured: StructuredOutputs | None = _wire(
        None,
        openai=(
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        ),
        note="OpenAI's response_format, vLLM's structured_outputs and its older guided_*",
    )
    # stop_token_ids as a set, for the per-token check on the engine's hot path
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.stop, str):
            set_(self, "stop", (self.stop,))
        set_(self, "stop", tuple(self.stop))
        set_(self, "stop_token_ids", tuple(self.stop_token_ids))
        set_(self, "logit_bias", tuple(tuple(x) for x in self.logit_bias))
        set_(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        set_(self, "bad_words", tuple(self.bad_words))
        if self.top_k is not None and _is_int(self.top_k) and self.top_k in (0, -1):
            set_(self, "top_k", None)
        self._validate()
        set_(self, "stop_token_set", frozenset(self.stop_token_ids))

    def _validate(self) -> None:
        def bad(field: str, limit: str) -> InvalidRequest:
            return InvalidRequest(field, getattr(self, field), limit)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise bad("top_k", "must be None, 0 or -1 (disabled) or an integer >= 1")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_num(value) or abs(value) > MAX_ABS_PENALTY:
                raise bad(name, f"must be a number in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}]")
        if not _is_num(self.repetition_penalty) or not (
            0 < self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY}]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise bad("seed", f"must be None or an integer in [0, {MAX_SEED}]")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_N:
            raise bad("beam_width", f"must be an integer in [1, {MAX_N}] (1 = no beam search)")
        if not _is_num(self.length_penalty) or abs(self.length_penalty) > MAX_LENGTH_PENALTY:
            raise bad(
                "length_penalty",
                f"must be a finite number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]",
            )
        if self.early_stopping not in (True, False, "never") or _is_int(self.early_stopping):
            raise bad("early_stopping", "must be True, False or 'never'")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                "stop", f"<{len(self.stop)} strings>", f"must be at most {MAX_STOP_STRINGS} strings"
            )
        limit = f"each must be a non-empty string of at most {MAX_STOP_STRING_CHARS} characters"
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", limit)
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest("stop", f"<{len(s)} chars>", limit)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                "stop_token_ids",
                f"<{len(self.stop_token_ids)} ids>",
                f"must hold at most {MAX_STOP_TOKEN_IDS} token ids",
            )
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                "logit_bias",
                f"<{len(self.logit_bias)} entries>",
                f"must hold at most {MAX_LOGIT_BIAS} entries",
            )
        for entry in self.logit_bias:
            if not (
                len(entry) == 2
                and _is_int(entry[0])
                and entry[0] >= 0
                and _is_num(entry[1])
                and -100 <= entry[1] <= 100
            ):
                raise InvalidRequest(
                    "logit_bias", entry, "entries must be (token id >= 0, bias in [-100, 100])"
                )
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise InvalidRequest(
                "allowed_token_ids",
                f"<{len(self.allowed_token_ids)} ids>",
                f"must hold at most {MAX_ALLOWED_TOKEN_IDS} token ids",
            )
        if not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids):
            raise InvalidRequest(
                "allowed_token_ids", "<list>", "must be non-negative integer token ids"
            )
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequest(
                "bad_words", f"<{len(self.bad_words)} words>", f"must be at most {MAX_BAD_WORDS}"
            )
        limit = f"each must be a non-blank string of at most {MAX_STOP_STRING_CHARS} characters"
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip():
                raise bad("bad_words", limit)
            if len(w) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest("bad_words", f"<{len(w)} chars>", limit)
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if not _is_int(self.priority):
            raise bad("priority", "must be an integer")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= 256
        ):
            raise bad("cache_salt", "must be None or a non-empty string of <= 256 characters")
        if self.lora is not None and (
            not isinstance(self.lora, str) or not 0 < len(self.lora) <= 64
        ):
            raise bad("lora", "must be None or an adapter name of 1-64 characters")
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "must be a bool")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise bad("structured", "must be None or a StructuredOutputs")
        if self.use_beam_search:
            if self.structured is not None:
                raise InvalidRequest(
                    "beam_width",
                    self.beam_width,
                    f"beam search cannot be combined with structured outputs "
                    f"({self.structured.field}); use n > 1 samples instead",
                )
            if self.n > self.beam_width:
                raise bad("n", f"must be <= beam_width={self.beam_width} with beam search")
            if self.stop:
                raise bad("stop", "stop strings are not supported with beam search")
            if self.logprobs is not None:
                raise bad("logprobs", "logprobs are not supported with beam search")
            if self.prompt_logprobs is not None:
                raise bad("prompt_logprobs", "prompt logprobs are not supported with beam search")
            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
                if getattr(self, name) != DEFAULTS[name]:
                    raise bad(name, "penalties are not supported with beam search")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def width(self) -> int:
        """Sequences this request runs at once (beams or parallel samples)."""
        return self.beam_width if self.use_beam_search else self.n

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a mapping; unknown keys are an error naming the valid ones."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            field = unknown[0]
            raise InvalidRequest(field, values[field], f"unknown field; valid: {sorted(known)}")
        return cls(**values)


# where each field travels, by name (init fields only: ``stop_token_set`` is derived)
WIRE: dict[str, Wire] = {f.name: _wire_of(f) for f in fields(SamplingParams) if f.init}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(SamplingParams) if f.init}
