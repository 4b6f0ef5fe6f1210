"""An on-disk cache of tokenizers rebuilt from GGUF metadata, shared by every process that
opens the same file (each worker and the router): the rebuild of a 262k-token vocabulary
takes seconds, loading its ``tokenizers`` JSON a fraction of that.

An entry is keyed by a SHA-256 over the raw bytes of every metadata entry the rebuild reads
(all ``tokenizer.*`` keys and ``general.architecture``, each with its key and type), the
file's GGUF version, the rebuild's version and the ``tokenizers`` version. The path and mtime
play no part: a copy of the file hits, any changed tokenizer byte misses. An entry is one
header line (its key, the length and SHA-256 of the body) and the body (the special tokens
and chat template as one JSON line, then the tokenizer JSON); one that does not check out
is rebuilt and replaced. Entries are written to a temporary file and renamed, so processes
starting at once each see a whole entry or none. The cache is an optimisation only: a
directory that cannot be read or written leaves the load to the rebuild.

The cache is bounded: after each store the least recently used entries (a hit refreshes an
entry's mtime) go until the entries fit in :data:`MAX_BYTES`; the entry just stored always
stays. A temporary file names its writer (pid and host); one whose writer is dead on this
host, or any older than :data:`STALE_TMP_SECONDS`, is a killed writer's and is removed then
too. Every removal may race another process's: a file already gone is fine, and a reader
that opened an entry before it was removed still reads it whole.

Directory: ``gguf-tokenizers/`` under ``kvstore.runtime.cache_dir.cache_root()``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvstore.runtime.cache_dir import cache_root
from worker.model.gguf_reader import GGUFFile

log = logging.getLogger(__name__)

FORMAT = 1  # of an entry's header and payload
SUBDIR = "gguf-tokenizers"
MAX_BYTES = 512 * 2**20  # entries kept at most (one of a 262k vocabulary is ~15 MB)
STALE_TMP_SECONDS = 3600.0  # a write takes seconds: a temporary file this old is abandoned
# ".<digest prefix>.<pid>@<host>.<random>.tmp" (mkstemp's random part has no dot)
_TMP_NAME = re.compile(r"^\.[0-9a-f]{16}\.(\d+)@(.+)\.[^.]*\.tmp$")

Built = tuple[HFTokenizer, dict[str, Any]]


def depends_on(key: str) -> bool:
    """The metadata keys a rebuilt tokenizer depends on (a superset of what it reads)."""
    return key.startswith("tokenizer.") or key == "general.architecture"


def tokenizer_digest(reader: GGUFFile, rebuild_version: int) -> str:
    """SHA-256 of what the tokenizer is built from: a few MB of the map for a 262k
    vocabulary (milliseconds), hashed as written rather than re-encoded from the values."""
    h = hashlib.sha256(
        f"kvcluster-gguf-tokenizer format={FORMAT} rebuild={rebuild_version} "
        f"tokenizers={tokenizers.__version__} gguf={reader.version}\n".encode()
    )
    for key in sorted(k for k in reader.spans if depends_on(k)):
        h.update(reader.raw(key))  # self-delimiting: key length, key, type, value
    return h.hexdigest()


def _entry(digest: str) -> Path | None:
    try:
        return cache_root() / SUBDIR / f"{digest}.tok"
    except RuntimeError as exc:  # no home directory to put it in
        log.warning("no tokenizer cache directory (%s): not caching", exc)
        return None


def load(digest: str) -> Built | None:
    """The cached tokenizer, or None if there is none or it does not check out."""
    path = _entry(digest)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("tokenizer cache %s is unreadable (%s): rebuilding", path, exc)
        return None
    try:
        head, _, body = data.partition(b"\n")
        header = json.loads(head)
        if (
            header.get("format") != FORMAT
            or header.get("digest") != digest
            or header.get("body_bytes") != len(body)
            or header.get("body_sha256") != hashlib.sha256(body).hexdigest()
        ):
            raise ValueError("the header does not match the entry")
        special, _, payload = body.partition(b"\n")
        built = HFTokenizer.from_str(payload.decode("utf-8")), json.loads(special)
    except Exception as exc:  # noqa: BLE001 - any damage means: rebuild
        log.warning("tokenizer cache %s is corrupt (%s): rebuilding", path, exc)
        return None
    try:
        os.utime(path)  # mtime is the entry's last use, for eviction
    except OSError:
        pass  # a read-only cache: used, never evicted by us
    return built


def store(digest: str, backend: HFTokenizer, special: dict[str, Any]) -> Path | None:
    """Write the entry atomically; None (and a warning) if the cache is not writable."""
    path = _entry(digest)
    if path is None:
        return None
    # The body, all of it checksummed: the special tokens (one JSON line), the tokenizer
    body = json.dumps(special).encode("utf-8") + b"\n" + backend.to_str().encode("utf-8")
    header = {
        "format": FORMAT,
        "digest": digest,
        "body_bytes": len(body),
        "body_sha256": hashlib.sha256(body).hexdigest(),
    }
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{digest[:16]}.{os.getpid()}@{socket.gethostname()}."
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header).encode("utf-8") + b"\n")
            f.write(body)
        os.replace(tmp, path)  # atomic: a reader sees the old entry, or the whole new one
    except OSError as exc:
        log.warning("tokenizer cache %s is not writable (%s): not caching", path.parent, exc)
        if tmp is not None:
            _unlink(tmp)
        return None
    tidy(path.parent, keep=path)
    return path


def tidy(folder: Path, keep: Path | None = None) -> None:
    """Remove dead writers' temporary files, then the least recently used entries until the
    rest fit in ``MAX_BYTES`` (never ``keep``). Safe while other processes read, write and
    tidy the same folder."""
    now = time.time()
    found: list[tuple[float, int, str]] = []  # entries: (last use, size, path)
    try:
        with os.scandir(folder) as listing:
            for item in listing:
                try:
                    st = item.stat()
                except FileNotFoundError:
                    continue  # removed meanwhile
                if item.name.endswith(".tmp"):
                    if _abandoned(item.name, now - st.st_mtime):
                        _unlink(item.path)
                elif item.name.endswith(".tok"):
                    found.append((st.st_mtime, st.st_size, item.path))
    except OSError as exc:
        log.warning("tokenizer cache %s cannot be listed (%s): not tidied", folder, exc)
        return
    total = sum(size for _, size, _ in found)
    for _, size, entry in sorted(found):
        if total <= MAX_BYTES:
            break
        if keep is None or entry != str(keep):
            _unlink(entry)
            total -= size


def _abandoned(name: str, age_s: float) -> bool:
    """A temporary file no live writer will rename: its writer is dead on this host, or it
    is too old to be a write in progress (another host's writer, a reused pid)."""
    if age_s > STALE_TMP_SECONDS:
        return True
    m = _TMP_NAME.match(name)
    if m is None or m.group(2) != socket.gethostname():
        return False
    pid = int(m.group(1))
    if pid == os.getpid():
        return False  # this process's (another thread's write)
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists (another user's)
    return False


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # gone already (another process tidied it) or not ours to remove


def cached(digest: str, build: Callable[[], Built]) -> Built:
    """The tokenizer with this digest from the cache, else ``build()`` (then cached)."""
    hit = load(digest)
    if hit is not None:
        return hit
    backend, special = build()
    store(digest, backend, special)
    return backend, special
