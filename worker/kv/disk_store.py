"""One worker's disk KV store: cached blocks in run files under a directory, below host memory.

Pure Python and numpy (no torch): the caller hands in a run's payload as bytes (one
``block_bytes`` slice per block, in the canonical layout of ``worker/model/kv_run.py``) and
gets them back the same way.

- **Content-addressed.** A block is found by its chained key (model, adapter and tenant salt
  are folded into it) *and* its token ids; a run file is named by a digest of its keys. Every
  block carries a checksum over the store's fingerprint (model and KV layout), its key, its
  tokens and its bytes (:mod:`worker.kv.disk_format`).
- **Runs.** :meth:`DiskKVStore.store_run` takes a chained run (parent first) and writes it
  as one file, or a few of at most ``max_blocks_per_file`` blocks; an in-memory index maps
  each key to its file and position.
- **Off the caller's thread.** The caller copies the bytes into a job and returns; a
  :class:`~worker.kv.disk_writer.DiskWriter` thread checksums, writes a temp file, fsyncs,
  renames it into place and fsyncs the directory. A full queue drops the store (counted): the
  engine never waits for the disk. A block becomes readable, and is reported by
  :meth:`drain_changes`, only once its file is durable.
- **Budget.** Run files count against ``capacity_bytes``; the least recently written or read
  file goes first. Files holding pinned blocks (:meth:`pin`, and every read while it runs)
  are never evicted or deleted under a reader.
- **Admission.** ``admit_after=2`` writes a block only the second time it is offered (a
  bounded memory of keys seen once); the default 1 writes on the first.
- **Restart-safe.** Opening the store scans the directory: leftover temp files, and run files
  that are truncated, fail a checksum or were written under another fingerprint are deleted,
  never served; :meth:`held_runs` lists what is left (for the index, under the worker's new
  epoch). A read checks the block checksums again and returns None on any mismatch (the
  caller recomputes).
- **Faults degrade.** A missing, unusable or full directory turns the store off with one log
  line (``stats().off_reason``); every call then answers "not here" and nothing raises into
  the caller. Turning off reports every held key removed.
- **Read or recompute.** :meth:`estimated_load_seconds` prices a hit from the measured read
  rate (:class:`~worker.kv.disk_read_rate.ReadRate`: a timed read at open, then real reads);
  :meth:`should_read` compares it with the caller's recompute estimate and counts skips.

Thread-safety: every public method may be called from any thread; one lock guards the index,
and no I/O happens under it except unlinking a dead file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.blocks.hashing import BlockKey
from worker.kv import disk_files
from worker.kv.disk_admission import DiskAdmission
from worker.kv.disk_format import (
    SUFFIX,
    CorruptRunFile,
    RunFileHeader,
    block_checksum,
    encode_header,
    run_file_name,
)
from worker.kv.disk_read_rate import ReadRate
from worker.kv.disk_types import DiskPin, DiskRemoved, DiskRun, DiskStoreStats
from worker.kv.disk_writer import DiskWriter

log = logging.getLogger(__name__)

DEFAULT_READ_BYTES_PER_S = 200e6  # used only if the store opens with nothing to time


@dataclass(slots=True)
class _WriteJob:
    """A run queued for the writer thread (bytes copied off the caller's buffer)."""

    keys: tuple[BlockKey, ...]
    parent: BlockKey | None
    token_ids: tuple[tuple[int, ...], ...]
    payload: bytes  # len(keys) * block_bytes


class _RunFile:
    """A durable run file and which of its blocks the index still serves from it."""

    __slots__ = ("name", "header", "size", "live", "pins", "doomed")

    def __init__(self, name: str, header: RunFileHeader, size: int) -> None:
        self.name = name
        self.header = header
        self.size = size  # bytes on disk (counted against the budget until unlinked)
        self.live: set[BlockKey] = set(header.keys)  # keys the index maps here
        self.pins = 0  # pins and reads in flight; a pinned file is never unlinked
        self.doomed = False  # dropped from the index while pinned: unlink at last unpin


class DiskKVStore:
    """Run files of KV blocks under ``path`` within ``capacity_bytes`` (0: the store is off).

    ``fingerprint`` names the model and KV layout (a file with another is foreign);
    ``block_bytes`` is the size of one block's payload.

    Caller's obligations: the runs stored are chained (parent first) and their payload is
    ``len(keys) * block_bytes`` bytes in the caller's canonical layout; a :class:`DiskPin` is
    released exactly once; :meth:`drain_changes` is drained regularly (it grows otherwise);
    :meth:`close` before dropping the store.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fingerprint: str,
        block_bytes: int,
        admit_after: int = 1,
        max_blocks_per_file: int = 32,
        max_queued_runs: int = 16,
        max_queued_bytes: int = 256 << 20,
        verify_at_open: bool = True,
        probe_bytes: int = 1 << 20,
        read_rate_alpha: float = 0.2,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"disk capacity_bytes must be >= 0, got {capacity_bytes}")
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        if max_blocks_per_file < 1:
            raise ValueError(f"max_blocks_per_file must be >= 1, got {max_blocks_per_file}")
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.max_blocks_per_file = max_blocks_per_file
        self.verify_at_open = verify_at_open
        self.rate = ReadRate(DEFAULT_READ_BYTES_PER_S, alpha=read_rate_alpha)
        self._lock = threading.Lock()
        self._files: OrderedDict[str, _RunFile] = OrderedDict()  # LRU: least recent first
        self._index: dict[BlockKey, tuple[_RunFile, int]] = {}  # key -> (file, position)
        self._pending: set[BlockKey] = set()  # queued or being written
        self._doomed: dict[str, _RunFile] = {}  # dropped while pinned: unlinked at last unpin
        self._admission = DiskAdmission(admit_after, capacity_bytes // block_bytes)
        self._changes: list[DiskRun | DiskRemoved] = []
        self._usage = 0
        self._enabled = capacity_bytes > 0
        self._off_reason = "" if self._enabled else "no budget (disk_kv_bytes=0)"
        self._c = dict.fromkeys(
            (
                "reads",
                "read_blocks",
                "read_bytes",
                "read_misses",
                "writes",
                "written_blocks",
                "written_bytes",
                "dropped_writes",
                "not_admitted",
                "skipped_reads",
                "evictions",
                "corrupt",
                "errors",
            ),
            0,
        )
        self._writer: DiskWriter[_WriteJob] | None = None
        if not self._enabled:
            return
        try:
            os.makedirs(self.path, exist_ok=True)
            self._open(probe_bytes)
        except OSError as exc:
            with self._lock:
                self._c["errors"] += 1
                self._turn_off(f"cannot use {self.path}: {exc}")
            return
        self._writer = DiskWriter(self._write, max_jobs=max_queued_runs, max_bytes=max_queued_bytes)

    # ---- queries ---------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def lookup(self, keys: Sequence[BlockKey], token_ids: Sequence[Sequence[int]]) -> int:
        """How many leading ``keys`` the store holds with these token ids (pure query)."""
        with self._lock:
            n = 0
            for key, toks in zip(keys, token_ids, strict=False):
                at = self._index.get(key)
                if at is None or at[0].header.token_ids[at[1]] != tuple(toks):
                    break
                n += 1
            return n

    def held_runs(self) -> list[DiskRun]:
        """Every run of blocks held, as chained runs, each after the run holding its parent
        (what a restarted worker announces)."""
        with self._lock:
            runs = [r for f in self._files.values() for r in self._live_runs(f)]
        run_of = {key: r for r in runs for key in r.keys}
        order: list[DiskRun] = []
        done: set[int] = set()
        for r in runs:
            chain: list[DiskRun] = []
            at: DiskRun | None = r
            while at is not None and id(at) not in done:  # up to an ancestor listed already
                chain.append(at)
                done.add(id(at))
                at = run_of.get(at.parent) if at.parent is not None else None
            order.extend(reversed(chain))
        return order

    def estimated_load_seconds(self, n_blocks: int) -> float:
        """Estimated seconds to read ``n_blocks`` blocks at the measured rate."""
        return self.rate.seconds_for(n_blocks * self.block_bytes)

    def should_read(self, n_blocks: int, recompute_seconds: float) -> bool:
        """Whether reading ``n_blocks`` beats recomputing them in ``recompute_seconds``;
        a hit not worth reading is counted as a skipped read."""
        if self.estimated_load_seconds(n_blocks) < recompute_seconds:
            return True
        with self._lock:
            self._c["skipped_reads"] += 1
        return False

    def stats(self) -> DiskStoreStats:
        with self._lock:
            return DiskStoreStats(
                enabled=self._enabled,
                capacity_bytes=self.capacity_bytes,
                usage_bytes=self._usage,
                blocks=len(self._index),
                files=len(self._files),
                queued_writes=self._writer.queued if self._writer else 0,
                read_bytes_per_s=self.rate.bytes_per_s,
                off_reason=self._off_reason,
                **self._c,
            )

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (used by the tests):
        the index and the files agree, and the usage gauge is the bytes of the files held."""
        with self._lock:
            for key, (f, pos) in self._index.items():
                assert self._files.get(f.name) is f, f"{key.hex()[:8]}: file {f.name} not held"
                assert f.header.keys[pos] == key and key in f.live, f"{key.hex()[:8]}: bad slot"
            for f in self._files.values():
                assert f.live and not f.doomed, f"{f.name}: held with no live block"
                assert all(self._index[k][0] is f for k in f.live), f"{f.name}: live key elsewhere"
            assert all(f.doomed and f.pins for f in self._doomed.values()), "doomed unpinned"
            assert not self._pending & self._index.keys(), "a queued key is already held"
            files = [*self._files.values(), *self._doomed.values()]
            if self._enabled:
                assert self._usage >= sum(f.size for f in files), "usage below the files held"
                assert self._usage <= self.capacity_bytes, "usage over the budget"

    def drain_changes(self) -> list[DiskRun | DiskRemoved]:
        """Runs that became durable and keys that left, in order, since the last call."""
        with self._lock:
            out, self._changes = self._changes, []
            return out

    # ---- writes ----------------------------------------------------------------------------

    def store_run(
        self,
        keys: Sequence[BlockKey],
        parent: BlockKey | None,
        token_ids: Sequence[Sequence[int]],
        payload: object,
    ) -> int:
        """Queue a chained run (parent first) for writing; returns the blocks queued.

        Blocks already held or queued, and blocks not admitted yet, are skipped (the rest is
        written as the runs between them). ``payload``: any C-contiguous buffer or numpy array
        of ``len(keys) * block_bytes`` bytes; it is copied before this returns. Never blocks:
        a full queue drops the run (``dropped_writes``).
        """
        n = len(keys)
        if len(token_ids) != n:
            raise ValueError(f"{n} keys but {len(token_ids)} token blocks")
        data = _bytes_view(payload)
        if len(data) != n * self.block_bytes:
            raise ValueError(
                f"payload is {len(data)} bytes, expected {n} blocks x {self.block_bytes}"
            )
        queued = 0
        with self._lock:
            if not self._enabled or self._writer is None:
                self._c["dropped_writes"] += 1
                return 0
            take = [self._admit(k) for k in keys]
            i = 0
            while i < n:
                if not take[i]:
                    i += 1
                    continue
                j = i
                while j < n and take[j] and j - i < self.max_blocks_per_file:
                    j += 1
                job = _WriteJob(
                    tuple(keys[i:j]),
                    keys[i - 1] if i else parent,
                    tuple(tuple(t) for t in token_ids[i:j]),
                    bytes(data[i * self.block_bytes : j * self.block_bytes]),
                )
                if self._writer.submit(job, len(job.payload)):
                    self._pending.update(job.keys)
                    queued += j - i
                else:
                    self._c["dropped_writes"] += 1
                i = j
        return queued

    def discard(self, keys: Sequence[BlockKey]) -> None:
        """Stop serving ``keys`` (the caller holds them in a faster tier now); a queued
        write of them lands without them."""
        with self._lock:
            gone: list[BlockKey] = []
            for key in keys:
                self._pending.discard(key)
                at = self._index.pop(key, None)
                if at is None:
                    continue
                f = at[0]
                f.live.discard(key)
                gone.append(key)
                if not f.live:
                    self._drop(f, "discarded")
            if gone:
                self._changes.append(DiskRemoved(tuple(gone), "discarded"))

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Make the files holding ``keys`` the most recently used."""
        with self._lock:
            for key in keys:
                at = self._index.get(key)
                if at is not None:
                    self._files.move_to_end(at[0].name)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has landed (or was dropped); False on timeout."""
        return self._writer.drain(timeout) if self._writer else True

    def close(self) -> None:
        """Finish queued writes and stop the writer thread."""
        if self._writer is not None:
            self._writer.close()

    # ---- reads -----------------------------------------------------------------------------

    def pin(self, keys: Sequence[BlockKey], token_ids: Sequence[Sequence[int]]) -> DiskPin:
        """Pin the files of the leading ``keys`` held (with these tokens) until
        :meth:`release`, so a later :meth:`read` of them finds them."""
        with self._lock:
            held: list[BlockKey] = []
            files: list[_RunFile] = []
            for key, toks in zip(keys, token_ids, strict=False):
                at = self._index.get(key)
                if at is None or at[0].header.token_ids[at[1]] != tuple(toks):
                    break
                held.append(key)
                if at[0] not in files:
                    files.append(at[0])
            for f in files:
                f.pins += 1
            return DiskPin(tuple(held), tuple(f.name for f in files))

    def release(self, pin: DiskPin) -> None:
        assert not pin.released, "disk pin released twice"
        pin.released = True
        with self._lock:
            for name in pin.files:
                self._unpin_name(name)

    def read(
        self, keys: Sequence[BlockKey], token_ids: Sequence[Sequence[int]]
    ) -> np.ndarray | None:
        """The payloads of ``keys`` as ``uint8 [len(keys), block_bytes]``, or None unless the
        store holds every one of them with these tokens and each passes its checksum (a block
        that fails is deleted, never served)."""
        n = len(keys)
        if n == 0 or len(token_ids) != n:
            return None
        with self._lock:
            where: list[tuple[_RunFile, int]] = []
            for key, toks in zip(keys, token_ids, strict=True):
                at = self._index.get(key)
                if not self._enabled or at is None or at[0].header.token_ids[at[1]] != tuple(toks):
                    self._c["read_misses"] += 1
                    return None
                where.append(at)
            files = list({id(f): f for f, _ in where}.values())
            for f in files:
                f.pins += 1
        out = np.empty((n, self.block_bytes), dtype=np.uint8)
        t0 = time.perf_counter()
        bad: _RunFile | None = None
        io_error: OSError | None = None
        try:
            for f, lo, hi, first in _contiguous(where):
                bad = f
                disk_files.pread_into(os.path.join(self.path, f.name), out[lo:hi], f.header, first)
                for i in range(lo, hi):
                    pos = first + i - lo
                    want = f.header.checksums[pos]
                    if block_checksum(self.fingerprint, keys[i], token_ids[i], out[i]) != want:
                        raise CorruptRunFile(f"block {pos} of {f.name}: checksum mismatch")
            bad = None
        except CorruptRunFile as exc:
            log.warning("disk KV tier: %s; deleted, recomputing", exc.reason)
        except OSError as exc:
            io_error = exc
        elapsed = time.perf_counter() - t0
        with self._lock:
            for f in files:
                self._unpin(f)
            if bad is not None:
                self._c["read_misses"] += 1
                if io_error is not None:
                    self._c["errors"] += 1
                    log.warning("disk KV tier: reading %s failed: %s", bad.name, io_error)
                else:
                    self._c["corrupt"] += 1
                if self._files.get(bad.name) is bad:
                    self._drop(bad, "corrupt")
                return None
            self._c["reads"] += 1
            self._c["read_blocks"] += n
            self._c["read_bytes"] += out.nbytes
            for f in files:
                if f.name in self._files:
                    self._files.move_to_end(f.name)
        self.rate.observe(out.nbytes, elapsed)
        return out

    # ---- the writer thread -----------------------------------------------------------------

    def _write(self, job: _WriteJob) -> None:
        """Write one run durably (temp file, fsync, rename, fsync the directory), then index
        it. Runs on the writer thread."""
        with self._lock:
            if not any(k in self._pending for k in job.keys):
                return  # every block of it was discarded while queued
            if not self._enabled:
                self._c["dropped_writes"] += 1
                return
        bb = self.block_bytes
        checks = [
            block_checksum(self.fingerprint, k, t, memoryview(job.payload)[i * bb : (i + 1) * bb])
            for i, (k, t) in enumerate(zip(job.keys, job.token_ids, strict=True))
        ]
        head = encode_header(self.fingerprint, bb, job.parent, job.keys, job.token_ids, checks)
        size = len(head) + len(job.payload)
        name = run_file_name(job.keys)
        with self._lock:
            # a dropped file of the same name still pinned by a reader would be unlinked
            # from under the new one: drop this write instead (rare: the same run again)
            if name in self._doomed or not self._make_room(size):
                self._pending.difference_update(job.keys)
                self._c["dropped_writes"] += 1
                return
            self._usage += size  # reserved while the file is written
        final = os.path.join(self.path, name)
        tmp = final + disk_files.TMP_SUFFIX
        try:
            disk_files.write_durably(tmp, final, self.path, head, job.payload)
        except OSError as exc:
            with self._lock:
                self._usage -= size
                self._pending.difference_update(job.keys)
                self._c["errors"] += 1
                self._turn_off(disk_files.describe_write_error(self.path, exc))
            disk_files.unlink_quietly(tmp)
            return
        header = RunFileHeader(
            self.fingerprint,
            bb,
            job.parent,
            job.keys,
            job.token_ids,
            tuple(checks),
            len(head),
        )
        with self._lock:
            f = _RunFile(name, header, size)
            f.live = {k for k in job.keys if k in self._pending and k not in self._index}
            self._pending.difference_update(job.keys)
            self._c["writes"] += 1
            self._c["written_blocks"] += len(job.keys)
            self._c["written_bytes"] += size
            if not self._enabled or not f.live:
                self._usage -= size
                disk_files.unlink_quietly(final)
                return
            self._register(f)
            self._changes.extend(self._live_runs(f))

    # ---- open ------------------------------------------------------------------------------

    def _open(self, probe_bytes: int) -> None:
        """Scan the directory: index intact run files, delete the rest; time the reads."""
        found: list[tuple[float, str]] = []
        for entry in os.scandir(self.path):
            if entry.name.endswith(disk_files.TMP_SUFFIX):
                disk_files.unlink_quietly(entry.path)  # an interrupted write
            elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                found.append((entry.stat().st_mtime, entry.name))
        found.sort()  # oldest first: the LRU order the files had, as far as the disk knows
        bad: list[str] = []
        read_bytes, read_s = 0, 0.0
        for _, name in found:
            t0 = time.perf_counter()
            try:
                header, size, payload_bytes = disk_files.load_run_file(
                    self.path, name, self.fingerprint, self.block_bytes, verify=self.verify_at_open
                )
            except CorruptRunFile as exc:
                bad.append(f"{name} ({exc.reason})")
                disk_files.unlink_quietly(os.path.join(self.path, name))
                continue
            read_s += time.perf_counter() - t0
            read_bytes += payload_bytes
            f = _RunFile(name, header, size)
            f.live = {k for k in header.keys if k not in self._index}
            if not f.live:
                disk_files.unlink_quietly(os.path.join(self.path, name))
                continue
            self._usage += size
            self._register(f)
        if bad:
            self._c["corrupt"] += len(bad)
            log.warning(
                "disk KV tier at %s: deleted %d run file(s) that cannot be served: %s",
                self.path,
                len(bad),
                "; ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""),
            )
        with self._lock:
            while self._usage > self.capacity_bytes and self._files:
                self._drop(next(iter(self._files.values())), "evicted")
            self._changes.clear()  # what is held is reported by held_runs, not as news
        if read_bytes >= probe_bytes > 0:
            self.rate = ReadRate(read_bytes / max(read_s, 1e-6), alpha=self.rate.alpha)
        elif probe_bytes > 0:
            self.rate = ReadRate(
                disk_files.probe_read_rate(self.path, probe_bytes), alpha=self.rate.alpha
            )
        log.info(
            "disk KV tier at %s: %d block(s) in %d file(s), %d of %d bytes; reads ~%.0f MB/s",
            self.path,
            len(self._index),
            len(self._files),
            self._usage,
            self.capacity_bytes,
            self.rate.bytes_per_s / 1e6,
        )

    # ---- bookkeeping (under the lock) ------------------------------------------------------

    def _admit(self, key: BlockKey) -> bool:
        """Whether to write ``key`` now (not held or queued, and admitted)."""
        if key in self._index or key in self._pending:
            return False
        if self._admission.admit(key):
            return True
        self._c["not_admitted"] += 1
        return False

    def _register(self, f: _RunFile) -> None:
        self._files[f.name] = f
        for pos, key in enumerate(f.header.keys):
            if key in f.live:
                self._index[key] = (f, pos)

    def _live_runs(self, f: _RunFile) -> list[DiskRun]:
        """The live blocks of ``f`` as chained runs (a discarded block splits a run)."""
        h = f.header
        runs: list[DiskRun] = []
        start = None
        for i in range(len(h.keys) + 1):
            live = i < len(h.keys) and h.keys[i] in f.live
            if live and start is None:
                start = i
            elif not live and start is not None:
                parent = h.keys[start - 1] if start else h.parent
                runs.append(DiskRun(h.keys[start:i], parent, h.token_ids[start:i]))
                start = None
        return runs

    def _make_room(self, size: int) -> bool:
        """Evict least recently used unpinned files until ``size`` more bytes fit."""
        if size > self.capacity_bytes:
            return False
        while self._usage + size > self.capacity_bytes:
            victim = next((f for f in self._files.values() if not f.pins), None)
            if victim is None:
                return False
            self._drop(victim, "evicted")
        return True

    def _drop(self, f: _RunFile, reason: str) -> None:
        """Forget ``f`` (reporting its live keys removed) and unlink it unless pinned."""
        del self._files[f.name]
        gone = [k for k in f.header.keys if k in f.live]
        for key in gone:
            del self._index[key]
        f.live.clear()
        if gone:
            self._changes.append(DiskRemoved(tuple(gone), reason))
            if reason == "evicted":
                self._c["evictions"] += len(gone)
        if f.pins:
            f.doomed = True
            self._doomed[f.name] = f
        else:
            self._unlink(f)

    def _unpin_name(self, name: str) -> None:
        f = self._files.get(name) or self._doomed.get(name)
        if f is not None:  # (None: the store turned off and forgot its files)
            self._unpin(f)

    def _unpin(self, f: _RunFile) -> None:
        assert f.pins > 0, f"unpinning {f.name} with no pin"
        f.pins -= 1
        if not f.pins and f.doomed:
            del self._doomed[f.name]
            self._unlink(f)

    def _unlink(self, f: _RunFile) -> None:
        self._usage -= f.size
        disk_files.unlink_quietly(os.path.join(self.path, f.name))

    def _turn_off(self, reason: str) -> None:
        """Stop serving and writing, once: one log line, every held key reported removed."""
        if not self._enabled:
            return
        self._enabled = False
        self._off_reason = reason
        log.warning("disk KV tier off: %s; KV stays in device and host memory only", reason)
        if self._index:
            self._changes.append(DiskRemoved(tuple(self._index), "off"))
        self._index.clear()
        self._files.clear()
        self._pending.clear()
        for f in self._doomed.values():
            f.doomed = False  # left on disk with the rest: the next open verifies them all
        self._doomed.clear()
        self._usage = 0  # the gauge counts what the store serves; the files stay on disk


def _bytes_view(payload: object) -> memoryview:
    """A flat byte view of a buffer or numpy array (no copy)."""
    if isinstance(payload, np.ndarray):
        payload = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    return memoryview(payload).cast("B")  # type: ignore[arg-type]


def _contiguous(
    where: list[tuple[_RunFile, int]],
) -> Iterator[tuple[_RunFile, int, int, int]]:
    """Group consecutive blocks stored next to each other in one file: (file, lo, hi, first
    position) for ``out[lo:hi]``, one read each."""
    lo = 0
    for i in range(1, len(where) + 1):
        if i == len(where) or where[i][0] is not where[lo][0] or where[i][1] != where[i - 1][1] + 1:
            yield where[lo][0], lo, i, where[lo][1]
            lo = i
