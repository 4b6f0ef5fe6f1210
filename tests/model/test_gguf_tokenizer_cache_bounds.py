"""The tokenizer cache stays bounded and clean: past ``MAX_BYTES`` the least recently used
entries go (a hit counts as a use; the entry just stored stays), and temporary files of
writers killed mid-write are removed, while a live writer's are kept."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from worker.model import gguf_tokenizer_cache as tc

ROOT = Path(__file__).parents[2]


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVCLUSTER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / tc.SUBDIR


def backend() -> HFTokenizer:
    return HFTokenizer(WordLevel({"<unk>": 0, "keys": 1, "values": 2}, unk_token="<unk>"))


def digest(i: int) -> str:
    return f"{i:064x}"


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def used(folder: Path, i: int, ago_s: float) -> None:
    t = time.time() - ago_s
    os.utime(folder / f"{digest(i)}.tok", (t, t))


def test_past_the_bound_the_least_recently_used_entries_go(folder, monkeypatch):
    for i in (1, 2, 3):
        assert tc.store(digest(i), backend(), {"n": i}) is not None
    size = (folder / f"{digest(1)}.tok").stat().st_size
    for i, ago in ((1, 300), (2, 200), (3, 100)):
        used(folder, i, ago)
    monkeypatch.setattr(tc, "MAX_BYTES", 3 * size)
    loaded = tc.load(digest(1))  # a hit: entry 1 is now the most recently used
    assert loaded is not None and loaded[1] == {"n": 1}
    tc.store(digest(4), backend(), {"n": 4})
    assert names(folder) == {f"{digest(i)}.tok" for i in (1, 3, 4)}
    tc.store(digest(5), backend(), {"n": 5})
    assert names(folder) == {f"{digest(i)}.tok" for i in (1, 4, 5)}
    assert tc.load(digest(3)) is None and tc.load(digest(5)) is not None


def test_an_entry_larger_than_the_bound_stays_until_the_next_store(folder, monkeypatch):
    monkeypatch.setattr(tc, "MAX_BYTES", 1)
    tc.store(digest(1), backend(), {})
    assert names(folder) == {f"{digest(1)}.tok"}
    tc.store(digest(2), backend(), {})
    assert names(folder) == {f"{digest(2)}.tok"}


def test_a_killed_writers_temporary_file_is_removed_a_live_ones_kept(folder):
    # A writer killed between writing its temporary file and renaming it.
    code = (
        "import os\n"
        "from tokenizers import Tokenizer\n"
        "from tokenizers.models import WordLevel\n"
        "from worker.model import gguf_tokenizer_cache as tc\n"
        "os.replace = lambda *a: os._exit(9)\n"
        "tc.store('7' * 64, Tokenizer(WordLevel({'<unk>': 0}, unk_token='<unk>')), {})\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.Popen([sys.executable, "-c", code], env=env)
    assert killed.wait(timeout=120) == 9
    (left,) = names(folder)
    assert left.startswith(f".{'7' * 16}.{killed.pid}@") and left.endswith(".tmp")
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kept = {
            f".{'8' * 16}.{live.pid}@{host}.abc.tmp",  # a live writer on this host
            f".{'9' * 16}.{killed.pid}@other-host.abc.tmp",  # another host's: age decides
            ".0123456789abcdef-abc.tmp",  # a name without a writer, still fresh
        }
        old = ".fedcba9876543210-abc.tmp"  # too old to be a write in progress
        for name in (*kept, old):
            (folder / name).write_bytes(b"partial")
        t = time.time() - tc.STALE_TMP_SECONDS - 60
        os.utime(folder / old, (t, t))
        tc.store(digest(1), backend(), {})
        assert names(folder) == kept | {f"{digest(1)}.tok"}
    finally:
        live.kill()
        live.wait()
