"""The on-disk cache of tokenizers rebuilt from GGUF metadata: a cached load is the rebuild's
tokenizer token for token; any change to a tokenizer field misses; a damaged entry is
rebuilt; an unusable cache directory only costs the rebuild; processes starting at once all
load. The suite's cache directory is a tmp dir (tests/conftest.py); each test here uses its
own."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFWriter

from kvstore.runtime.cache_dir import cache_root
from tests.model.gguf_writer import write_gguf
from worker.model import gguf_tokenizer
from worker.model.gguf_file import open_gguf
from worker.model.gguf_tokenizer import REBUILD_VERSION, tokenizer_backend_from_gguf
from worker.model.gguf_tokenizer_cache import SUBDIR, depends_on, tokenizer_digest
from worker.model.tokenizer import Tokenizer

WORDS = ["▁the", "▁cache", "▁of", "▁keys", "▁and", "▁values", "▁two", "▁lines", "▁tab"]
TEXTS = [
    "the cache of keys and values",
    "  two leading spaces\n\nand lines\t and a tab",
    "ünïcode 🙂, 1234567, 中文 falls back to bytes",
    "<start_of_turn>user\nthe keys<end_of_turn>\n",
    "<tool> values </s> <s>",
    "",
]
TEMPLATE = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"


def sentencepiece_gguf(path: Path, **change) -> Path:
    """A metadata-only sentencepiece GGUF (scores, no merges: they are derived) with control
    and user-defined tokens; ``change`` overrides one field: ``score`` {token index: value},
    ``types`` {token index: type}, ``template``, ``add_bos``, ``context``."""
    pieces = sorted({w[:i] for w in WORDS for i in range(2, len(w) + 1)}, key=len)
    letters = sorted({c for w in WORDS for c in w})
    special = ["<start_of_turn>", "<end_of_turn>", "<tool>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [*letters, *pieces, *special]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 262) + [3, 3, 4]
    for i, v in change.get("score", {}).items():
        scores[i] = v
    for i, v in change.get("types", {}).items():
        types[i] = v
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(change.get("context", 64))
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(change.get("add_bos", True))
    w.add_chat_template(change.get("template", TEMPLATE))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVCLUSTER_CACHE", str(root))
    return root


@pytest.fixture
def no_rebuild(monkeypatch):
    """Makes a rebuild fail: a load that succeeds came from the cache."""

    def refuse(*_):
        raise AssertionError("rebuilt instead of loaded from the cache")

    return lambda: monkeypatch.setattr(gguf_tokenizer, "rebuild", refuse)


def entries(root: Path) -> list[Path]:
    return sorted((root / SUBDIR).iterdir()) if (root / SUBDIR).is_dir() else []


def assert_same(ours: Tokenizer, fresh: Tokenizer) -> None:
    assert ours.backend_json() == fresh.backend_json()
    for text in TEXTS:
        for add in (True, False):
            ids = fresh.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_special_tokens=add) == ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == fresh.decode(ids, skip)
    for name in ("bos_token", "eos_token", "pad_token", "chat_template", "eos_token_ids"):
        assert getattr(ours, name) == getattr(fresh, name), name
    assert ours.vocab_size == fresh.vocab_size
    assert ours.encode_chat([{"role": "user", "content": "the keys"}]) == fresh.encode_chat(
        [{"role": "user", "content": "the keys"}]
    )


def fresh(path: Path) -> Tokenizer:
    backend, special = tokenizer_backend_from_gguf(path, cache=False)
    return Tokenizer(backend, **special)


@pytest.fixture(scope="module")
def byte_level_gguf(model_dirs, tmp_path_factory) -> Path:
    return write_gguf(model_dirs["qwen2"], tmp_path_factory.mktemp("bl") / "qwen2.gguf")


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_a_cached_load_is_the_rebuilt_tokenizer(cache, tmp_path, no_rebuild, kind, request):
    if kind == "sentencepiece":
        path = sentencepiece_gguf(tmp_path / "sp.gguf")
    else:
        path = request.getfixturevalue("byte_level_gguf")
    ref = fresh(path)
    assert entries(cache) == []
    first = Tokenizer.from_gguf(path)  # a miss: rebuilt, then cached
    (entry,) = entries(cache)
    assert entry.name == f"{tokenizer_digest(open_gguf(path), REBUILD_VERSION)}.tok"
    no_rebuild()
    second = Tokenizer.from_gguf(path)
    assert_same(first, ref)
    assert_same(second, ref)


@pytest.mark.parametrize(
    "change",
    [
        {"score": {-4: 5.0}},  # the longest piece's score: its merges first
        {"types": {262: 3}},  # one token becomes a control token
        {"template": TEMPLATE + " "},
        {"add_bos": False},
    ],
    ids=["score", "token_type", "chat_template", "add_bos_token"],
)
def test_a_changed_tokenizer_field_misses_the_cache(cache, tmp_path, change):
    base = sentencepiece_gguf(tmp_path / "a.gguf")
    Tokenizer.from_gguf(base)
    changed = sentencepiece_gguf(tmp_path / "b.gguf", **change)
    assert tokenizer_digest(open_gguf(changed), REBUILD_VERSION) != tokenizer_digest(
        open_gguf(base), REBUILD_VERSION
    )
    ours = Tokenizer.from_gguf(changed)
    assert len(entries(cache)) == 2
    assert_same(ours, fresh(changed))
    before = fresh(base)
    assert (ours.backend_json(), ours.chat_template) != (
        before.backend_json(),
        before.chat_template,
    )


def test_the_key_is_the_tokenizer_metadata_not_the_path_or_other_fields(
    cache, tmp_path, no_rebuild
):
    Tokenizer.from_gguf(sentencepiece_gguf(tmp_path / "a.gguf"))
    # another path, another mtime, another non-tokenizer field: the same tokenizer bytes
    other = sentencepiece_gguf(tmp_path / "elsewhere.gguf", context=128)
    ref = fresh(other)
    no_rebuild()
    assert_same(Tokenizer.from_gguf(other), ref)
    assert len(entries(cache)) == 1


def test_the_digest_covers_whole_metadata_entries(tmp_path):
    """The entries' spans tile the metadata from the header to the tensor index, so a digest
    over the tokenizer keys' spans covers every byte of their keys, types and values."""
    reader = open_gguf(sentencepiece_gguf(tmp_path / "a.gguf"))
    spans = sorted(reader.spans.values())
    assert spans[0][0] == 24  # magic, version, tensor count, key/value count
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert set(reader.spans) == set(reader.fields)
    raw = bytes(reader.raw("tokenizer.chat_template"))
    assert raw.endswith(TEMPLATE.encode()) and b"tokenizer.chat_template" in raw


class _Recording(dict):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_the_rebuild_reads_only_keys_the_digest_covers(tmp_path, kind, request):
    if kind == "sentencepiece":
        path = sentencepiece_gguf(tmp_path / "sp.gguf")
    else:
        path = request.getfixturevalue("byte_level_gguf")
    reader = open_gguf(path)
    fields = _Recording(reader.fields)
    gguf_tokenizer.rebuild(dataclasses.replace(reader, fields=fields), str(path))
    assert "tokenizer.ggml.tokens" in fields.read
    assert {k for k in fields.read if not depends_on(k)} == set()


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b[:-40] + bytes([b[-40] ^ 1]) + b[-39:],  # one byte of the tokenizer
        lambda b: b.replace(b"<end_of_turn>", b"<end_of_turm>", 1),  # the special tokens
        lambda b: b"",
        lambda b: b"not json\n" + b,
    ],
    ids=["truncated", "payload_byte", "special_tokens", "empty", "header"],
)
def test_a_corrupt_entry_is_rebuilt(cache, tmp_path, no_rebuild, damage):
    path = sentencepiece_gguf(tmp_path / "a.gguf")
    ref = fresh(path)
    Tokenizer.from_gguf(path)
    (entry,) = entries(cache)
    good = entry.read_bytes()
    bad = damage(good)
    assert bad != good
    entry.write_bytes(bad)
    assert_same(Tokenizer.from_gguf(path), ref)
    assert entry.read_bytes() == good  # replaced by a whole entry
    no_rebuild()
    assert_same(Tokenizer.from_gguf(path), ref)


def test_an_unusable_cache_dir_still_loads(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVCLUSTER_CACHE", str(blocker / "cache"))  # under a file
    path = sentencepiece_gguf(tmp_path / "a.gguf")
    assert_same(Tokenizer.from_gguf(path), fresh(path))
    assert "not caching" in caplog.text
    assert set(tmp_path.iterdir()) == {blocker, path}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_cache_dir_still_loads(cache, tmp_path):
    cache.mkdir()
    cache.chmod(0o500)
    try:
        path = sentencepiece_gguf(tmp_path / "a.gguf")
        assert_same(Tokenizer.from_gguf(path), fresh(path))
    finally:
        cache.chmod(0o700)


def test_processes_opening_at_once_all_load(cache, tmp_path):
    path = sentencepiece_gguf(tmp_path / "a.gguf")
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "from worker.model.tokenizer import Tokenizer\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.005)\n"
        f"print(Tokenizer.from_gguf({str(path)!r}).encode({TEXTS[3]!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(3)
    ]
    go.write_text("")  # released together, once all have imported
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err.decode() for _, err in outs]
    expected = str(fresh(path).encode(TEXTS[3])) + "\n"
    assert [out.decode() for out, _ in outs] == [expected] * 3
    (entry,) = entries(cache)  # one whole entry, no temporary file left behind
    assert entry.suffix == ".tok"


def test_the_cache_dir_follows_the_conventions(monkeypatch, tmp_path):
    for var in ("KVCLUSTER_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "kvcluster"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "kvcluster"
    monkeypatch.setenv("KVCLUSTER_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
