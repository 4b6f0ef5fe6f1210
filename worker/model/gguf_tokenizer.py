"""Rebuild a GGUF file's tokenizer (llama.cpp keeps it as metadata, with no tokenizer.json)
as a ``tokenizers`` BPE, the way transformers does, so both tokenize identically:

* ``gpt2``: byte-level BPE with the file's merges and the pre-tokenizer split that
  ``tokenizer.ggml.pre`` names (GPT-2's own for any other name);
* ``llama``: sentencepiece-style BPE (``▁`` for spaces, byte fallback ``<0xNN>``), merges
  from the file or derived from the vocabulary and its scores.

Control tokens become special added tokens, user-defined ones plain added tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from worker.model.gguf_file import Meta, architecture, open_gguf
from worker.model.gguf_reader import GGUFFile
from worker.model.gguf_tokenizer_cache import cached, tokenizer_digest
from worker.model.load_errors import ModelLoadError, UnsupportedModelError

SUPPORTED_TOKENIZERS = ("gpt2", "llama")
# Part of the tokenizer cache's key: bump it whenever a change here changes what is built,
# so no process loads a tokenizer an older rebuild cached.
REBUILD_VERSION = 1
_CONTROL = 3  # llama.cpp token type of control tokens (<|im_start|>, ...)
_USER_DEFINED = 4  # llama.cpp token type of added, non-special tokens

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizer splits of the byte-level vocabularies llama.cpp names in tokenizer.ggml.pre
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (how byte-level vocabularies are written)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _byte_level(tokens: Sequence[str], meta: Meta) -> tuple[HFTokenizer, set[str]]:
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet is spelled into it (llama.cpp mislabels).
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # A control token outside the alphabet is skipped: adding it would grow the vocabulary
    # past the embedding's rows (as transformers does).
    return backend, {t for t in tokens if set(t) <= alphabet}


def derive_merges(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece vocabulary implies: every split of a token into two tokens,
    best score first (transformers' ``generate_merges``, so both tokenize alike).

    The same list as ``generate_merges``, in one sort: it sorts each token's splits by id and
    then all splits stably by (score, len(left), len(right)), descending; two splits of one
    token differ in len(left), so the per-token order never survives the second sort, and
    ties between tokens keep the order of ``scores``, as the counter here does."""
    out: list[tuple[float, int, int, int, str, str]] = []
    append = out.append
    for merge, score in scores.items():  # the hot loop of a 262k vocabulary: no calls
        n = len(merge)
        for i in range(1, n):
            left = merge[:i]
            if left in vocab:
                right = merge[i:]
                if right in vocab:
                    append((-score, -i, i - n, len(out), left, right))
    out.sort()  # the counter is unique: the strings are never compared
    return [(left, right) for *_, left, right in out]


def _sentencepiece(
    tokens: Sequence[str], meta: Meta, gemma: bool = False
) -> tuple[HFTokenizer, set[str]]:
    if gemma:  # Gemma files spell runs of spaces as spaces, its vocabulary as "▁" runs
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    elif gemma:  # Gemma's scores do not follow its merge order; the file's order does
        merges = derive_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    else:
        scores = meta.require("tokenizer.ggml.scores")
        merges = derive_merges(vocab, dict(zip(tokens, scores, strict=False)))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend, set(tokens)


def tokenizer_backend_from_gguf(
    path: str | Path, *, cache: bool = True
) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizer backend, and the special tokens / chat template as ``Tokenizer``'s
    keyword arguments: from the tokenizer cache (``gguf_tokenizer_cache``) when it holds one
    built from the same metadata, else rebuilt (and cached, unless ``cache=False``)."""
    reader, source = open_gguf(path), str(path)
    if not cache:
        return rebuild(reader, source)
    return cached(tokenizer_digest(reader, REBUILD_VERSION), lambda: rebuild(reader, source))


def rebuild(reader: GGUFFile, source: str) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizer rebuilt from the file's metadata (no cache)."""
    arch = architecture(reader, source)
    meta = Meta(reader, source)
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZERS:
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZERS)}"
        )
    tokens: Sequence[str] = meta.require("tokenizer.ggml.tokens")
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend, addable = _byte_level(tokens, meta)
    else:
        backend, addable = _sentencepiece(tokens, meta, gemma=arch == "gemma3")
    vocab = backend.get_vocab()
    pairs = list(zip(tokens, types, strict=False))
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, k in pairs
            if k == _CONTROL and t in addable
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, k in pairs
            if k == _USER_DEFINED and t in vocab
        ]
    )

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        if idx is None:
            return None
        if not 0 <= idx < len(tokens):
            raise ModelLoadError(f"{source}: tokenizer.ggml.{key}={idx} is outside the vocabulary")
        return tokens[idx]

    bos = token("bos_token_id")
    # llama.cpp adds bos to a sentencepiece vocabulary unless the file says otherwise
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    special = {
        "bos_token": bos,
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return backend, special
