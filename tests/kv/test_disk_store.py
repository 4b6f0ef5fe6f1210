"""The disk KV store: runs round-trip, LRU within the budget with pins, restart, corrupt or
foreign files never served, a writer that never blocks the caller, faults that turn it off,
admission, and the read-rate cost model."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvstore.blocks.hashing import BlockKey, HashContext, block_keys
from worker.kv import disk_files
from worker.kv.disk_format import (
    SUFFIX,
    decode_header,
    encode_header,
    fingerprint_of,
    header_length,
    run_file_name,
)
from worker.kv.disk_read_rate import ReadRate
from worker.kv.disk_store import DiskKVStore
from worker.kv.disk_types import DiskRemoved, DiskRun
from worker.kv.transfer import KVLayout

BS = 4  # tokens per block
BB = 64  # payload bytes per block
FP = "m|float32|L2H2D4"
CTX = HashContext("m")
LOGGER = "worker.kv.disk_store"


def _prompt(start: int, n_blocks: int, ctx: HashContext = CTX):
    toks = list(range(start, start + n_blocks * BS))
    keys = block_keys(toks, BS, ctx)
    return keys, [tuple(toks[i * BS : (i + 1) * BS]) for i in range(n_blocks)]


def _payload(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8)


def _open(path: Path, capacity: int = 1 << 20, **kw) -> DiskKVStore:
    kw.setdefault("probe_bytes", 4096)
    return DiskKVStore(path, capacity, fingerprint=FP, block_bytes=BB, **kw)


def _put(store: DiskKVStore, keys, toks, payload, parent=None) -> int:
    n = store.store_run(keys, parent, toks, payload)
    assert store.drain(10)
    return n


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX))


def _one_block_file_bytes(tmp_path: Path) -> int:
    probe = _open(tmp_path / "probe")
    keys, toks = _prompt(1000, 1)
    _put(probe, keys, toks, _payload(1))
    size = probe.stats().usage_bytes
    probe.close()
    return size


# ---- round trip ----------------------------------------------------------------------------


def test_a_run_is_written_in_files_of_at_most_max_blocks_and_read_back_exactly(tmp_path):
    store = _open(tmp_path, max_blocks_per_file=2)
    keys, toks = _prompt(0, 5)
    data = _payload(5)
    assert _put(store, keys, toks, data) == 5
    assert len(_files(tmp_path)) == 3
    changes = store.drain_changes()
    assert changes == [
        DiskRun(tuple(keys[0:2]), None, tuple(toks[0:2])),
        DiskRun(tuple(keys[2:4]), keys[1], tuple(toks[2:4])),
        DiskRun(tuple(keys[4:5]), keys[3], tuple(toks[4:5])),
    ]
    assert store.lookup(keys, toks) == 5
    assert np.array_equal(store.read(keys, toks), data)
    assert np.array_equal(store.read(keys[1:4], toks[1:4]), data[1:4])  # spans two files
    s = store.stats()
    assert (s.writes, s.written_blocks, s.reads, s.read_blocks) == (3, 5, 2, 8)
    assert s.read_bytes == 8 * BB and s.usage_bytes == sum(
        p.stat().st_size for p in _files(tmp_path)
    )
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    store.close()


def test_blocks_already_held_are_skipped_and_the_rest_chains_from_the_last_held(tmp_path):
    store = _open(tmp_path)
    keys, toks = _prompt(0, 4)
    data = _payload(4)
    _put(store, keys[:2], toks[:2], data[:2])
    store.drain_changes()
    assert _put(store, keys, toks, data) == 2
    assert store.drain_changes() == [DiskRun(tuple(keys[2:]), keys[1], tuple(toks[2:]))]
    assert np.array_equal(store.read(keys, toks), data)
    store.close()


def test_a_read_needs_every_key_with_its_tokens(tmp_path):
    store = _open(tmp_path)
    keys, toks = _prompt(0, 3)
    _put(store, keys[:2], toks[:2], _payload(2))
    assert store.read(keys, toks) is None  # keys[2] missing
    wrong = [toks[0], (9, 9, 9, 9)]
    assert store.read(keys[:2], wrong) is None  # a key collision never serves other tokens
    assert store.lookup(keys[:2], wrong) == 1
    assert store.stats().read_misses == 2
    store.close()


def test_payload_of_the_wrong_size_is_refused(tmp_path):
    store = _open(tmp_path)
    keys, toks = _prompt(0, 2)
    with pytest.raises(ValueError, match="expected 2 blocks"):
        store.store_run(keys, None, toks, b"\0" * (BB + 1))
    store.close()


# ---- budget, LRU, pins ---------------------------------------------------------------------


def test_lru_file_leaves_first_and_a_read_makes_a_file_recent(tmp_path):
    size = _one_block_file_bytes(tmp_path)
    store = _open(tmp_path / "d", capacity=2 * size)
    (a, ta), (b, tb), (c, tc), (d, td) = (_prompt(100 * i, 1) for i in range(4))
    _put(store, a, ta, _payload(1, 1))
    _put(store, b, tb, _payload(1, 2))
    _put(store, c, tc, _payload(1, 3))  # evicts a
    assert (store.lookup(a, ta), store.lookup(b, tb), store.lookup(c, tc)) == (0, 1, 1)
    assert store.read(b, tb) is not None  # b is now more recent than c
    _put(store, d, td, _payload(1, 4))  # evicts c
    assert (store.lookup(b, tb), store.lookup(c, tc), store.lookup(d, td)) == (1, 0, 1)
    removed = [c for c in store.drain_changes() if isinstance(c, DiskRemoved)]
    assert removed == [DiskRemoved((a[0],), "evicted"), DiskRemoved((c[0],), "evicted")]
    s = store.stats()
    assert s.evictions == 2 and s.usage_bytes == 2 * size and len(_files(tmp_path / "d")) == 2
    store.close()


def test_pinned_files_are_never_evicted_and_a_write_that_cannot_fit_is_dropped(tmp_path):
    size = _one_block_file_bytes(tmp_path)
    store = _open(tmp_path / "d", capacity=2 * size)
    (a, ta), (b, tb), (c, tc), (d, td) = (_prompt(100 * i, 1) for i in range(4))
    _put(store, a, ta, _payload(1, 1))
    _put(store, b, tb, _payload(1, 2))
    pin_a = store.pin(a, ta)
    assert len(pin_a) == 1
    _put(store, c, tc, _payload(1, 3))  # a is the oldest but pinned: b goes
    assert (store.lookup(a, ta), store.lookup(b, tb), store.lookup(c, tc)) == (1, 0, 1)
    pin_c = store.pin(c, tc)
    _put(store, d, td, _payload(1, 4))  # everything pinned: nothing fits
    assert store.lookup(d, td) == 0 and store.stats().dropped_writes == 1
    assert np.array_equal(store.read(a, ta), _payload(1, 1))
    store.release(pin_a)
    store.release(pin_c)
    _put(store, d, td, _payload(1, 4))  # a was read after c was written: c is older
    assert (store.lookup(a, ta), store.lookup(c, tc), store.lookup(d, td)) == (1, 0, 1)
    with pytest.raises(AssertionError):
        store.release(pin_a)
    store.close()


def test_a_file_dropped_while_pinned_is_deleted_at_its_last_unpin(tmp_path):
    store = _open(tmp_path)
    keys, toks = _prompt(0, 2)
    _put(store, keys, toks, _payload(2))
    pin = store.pin(keys, toks)
    store.discard(keys)  # the caller recomputed them
    assert store.lookup(keys, toks) == 0 and len(_files(tmp_path)) == 1
    store.release(pin)
    assert _files(tmp_path) == [] and store.stats().usage_bytes == 0
    store.close()


def test_discard_splits_a_run_and_a_discarded_queued_block_is_not_indexed(tmp_path, monkeypatch):
    store = _open(tmp_path)
    keys, toks = _prompt(0, 4)
    _put(store, keys, toks, _payload(4))
    store.drain_changes()
    store.discard([keys[1]])
    assert store.drain_changes() == [DiskRemoved((keys[1],), "discarded")]
    assert store.lookup(keys, toks) == 1
    runs = store.held_runs()
    assert runs == [
        DiskRun((keys[0],), None, (toks[0],)),
        DiskRun(tuple(keys[2:]), keys[1], tuple(toks[2:])),
    ]
    gate = _block_writer(monkeypatch)
    other, ot = _prompt(500, 2)
    assert store.store_run(other, None, ot, _payload(2)) == 2
    gate.entered.wait(5)
    store.discard([other[1]])
    gate.go.set()
    assert store.drain(10)
    assert store.lookup(other, ot) == 1
    store.close()


# ---- restart -------------------------------------------------------------------------------


def test_a_new_store_on_the_same_directory_finds_verifies_and_serves_the_runs(tmp_path):
    store = _open(tmp_path, max_blocks_per_file=2)
    keys, toks = _prompt(0, 5)
    data = _payload(5)
    # the tail first (as a host tier evicts: children before parents), then the head
    _put(store, keys[2:], toks[2:], data[2:], parent=keys[1])
    _put(store, keys[:2], toks[:2], data[:2])
    branch, bt = _prompt(0, 3)
    store.close()

    again = _open(tmp_path, max_blocks_per_file=2)
    assert again.drain_changes() == []
    runs = again.held_runs()
    assert runs[0] == DiskRun(tuple(keys[:2]), None, tuple(toks[:2]))  # parents first
    assert {r.keys for r in runs} == {tuple(keys[:2]), tuple(keys[2:4]), (keys[4],)}
    seen: set[BlockKey] = set()
    for r in runs:
        assert r.parent is None or r.parent in seen
        seen.update(r.keys)
    assert again.lookup(branch, bt) == 3
    assert np.array_equal(again.read(keys, toks), data)
    s = again.stats()
    assert s.blocks == 5 and s.files == 3 and s.corrupt == 0
    assert s.usage_bytes == sum(p.stat().st_size for p in _files(tmp_path))
    again.close()


def test_restart_with_a_smaller_budget_keeps_the_newest_files(tmp_path):
    size = _one_block_file_bytes(tmp_path)
    store = _open(tmp_path / "d")
    prompts = [_prompt(100 * i, 1) for i in range(3)]
    for i, (k, t) in enumerate(prompts):
        _put(store, k, t, _payload(1, i))
        os.utime(tmp_path / "d" / run_file_name(k), (1000 + i, 1000 + i))
    store.close()
    again = _open(tmp_path / "d", capacity=2 * size)
    assert [again.lookup(k, t) for k, t in prompts] == [0, 1, 1]
    assert len(_files(tmp_path / "d")) == 2
    again.close()


def test_leftover_temp_files_are_deleted_and_other_files_left_alone(tmp_path):
    (tmp_path / ("x" + SUFFIX + ".tmp")).write_bytes(b"half a run")
    (tmp_path / "notes.txt").write_text("mine")
    store = _open(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    store.close()


# ---- never served: truncated, corrupt, foreign ---------------------------------------------


def _one_run_on_disk(tmp_path: Path, n: int = 3, ctx: HashContext = CTX):
    store = _open(tmp_path)
    keys, toks = _prompt(0, n, ctx)
    _put(store, keys, toks, _payload(n))
    store.close()
    (path,) = _files(tmp_path)
    return keys, toks, path


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def _assert_refused_at_open(tmp_path, keys, toks, caplog, **kw):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = _open(tmp_path, **kw)
    assert store.lookup(keys, toks) == 0 and store.read(keys, toks) is None
    assert store.held_runs() == [] and _files(tmp_path) == []
    assert store.stats().corrupt == 1
    assert "cannot be served" in caplog.text
    store.close()
    return caplog.text


def test_a_truncated_file_is_deleted_at_open(tmp_path, caplog):
    keys, toks, path = _one_run_on_disk(tmp_path)
    os.truncate(path, path.stat().st_size - 1)
    assert "torn write" in _assert_refused_at_open(tmp_path, keys, toks, caplog)


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_flipped_byte_is_deleted_at_open(tmp_path, caplog, where):
    keys, toks, path = _one_run_on_disk(tmp_path)
    _flip(path, path.stat().st_size - 5 if where == "payload" else 30)
    text = _assert_refused_at_open(tmp_path, keys, toks, caplog)
    assert "checksum mismatch" in text


def test_a_flipped_byte_found_by_a_read_is_never_served_and_the_file_goes(tmp_path, caplog):
    keys, toks, path = _one_run_on_disk(tmp_path)
    store = _open(tmp_path, verify_at_open=False)  # headers only: the read must catch it
    assert store.lookup(keys, toks) == 3
    _flip(path, path.stat().st_size - 5)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.read(keys, toks) is None
    assert "checksum mismatch" in caplog.text
    assert store.lookup(keys, toks) == 0 and _files(tmp_path) == []
    assert store.drain_changes()[-1] == DiskRemoved(tuple(keys), "corrupt")
    s = store.stats()
    assert (s.corrupt, s.read_misses, s.reads, s.usage_bytes) == (1, 1, 0, 0)
    store.close()


def test_a_file_truncated_under_a_running_store_is_never_served(tmp_path):
    keys, toks, path = _one_run_on_disk(tmp_path)
    store = _open(tmp_path)
    os.truncate(path, path.stat().st_size - BB)
    assert store.read(keys, toks) is None
    assert store.read(keys[:1], toks[:1]) is None  # the whole file went
    store.close()


def test_files_of_another_model_fingerprint_are_deleted(tmp_path, caplog):
    keys, toks, _ = _one_run_on_disk(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        other = DiskKVStore(tmp_path, 1 << 20, fingerprint="m|bfloat16|L2H2D4", block_bytes=BB)
    assert other.lookup(keys, toks) == 0 and _files(tmp_path) == []
    assert "foreign fingerprint" in caplog.text
    other.close()


def test_another_tenants_keys_never_reach_a_tenants_blocks(tmp_path, caplog):
    a_ctx, b_ctx = HashContext("m", cache_salt="a"), HashContext("m", cache_salt="b")
    a_keys, toks, a_path = _one_run_on_disk(tmp_path, ctx=a_ctx)
    b_keys, b_toks = _prompt(0, 3, b_ctx)
    assert b_toks == toks and not set(a_keys) & set(b_keys)
    store = _open(tmp_path)
    assert store.lookup(b_keys, toks) == 0 and store.read(b_keys, toks) is None
    store.close()
    # a forged file: tenant a's bytes and checksums under tenant b's keys (a valid header)
    raw = a_path.read_bytes()
    head = decode_header(raw[: header_length(raw[:12])])
    forged = encode_header(FP, BB, None, b_keys, toks, head.checksums)
    a_path.unlink()
    (tmp_path / run_file_name(b_keys)).write_bytes(forged + raw[head.payload_offset :])
    text = _assert_refused_at_open(tmp_path, b_keys, toks, caplog)
    assert "checksum mismatch" in text


# ---- the writer thread ---------------------------------------------------------------------


def _block_writer(monkeypatch, *, before_rename: bool = False) -> SimpleNamespace:
    """Hold the writer thread inside its next durable write until ``gate.go`` is set
    (after writing the temp file if ``before_rename``)."""
    gate = SimpleNamespace(entered=threading.Event(), go=threading.Event())
    real = disk_files.write_durably

    def held(tmp, final, directory, head, payload):
        if before_rename:
            Path(tmp).write_bytes(head + payload)
        gate.entered.set()
        assert gate.go.wait(10)
        real(tmp, final, directory, head, payload)

    monkeypatch.setattr(disk_files, "write_durably", held)
    return gate


def test_writes_are_atomic_no_partial_file_is_visible_under_its_final_name(tmp_path, monkeypatch):
    gate = _block_writer(monkeypatch, before_rename=True)
    store = _open(tmp_path)
    keys, toks = _prompt(0, 2)
    store.store_run(keys, None, toks, _payload(2))
    gate.entered.wait(5)
    assert _files(tmp_path) == [] and store.lookup(keys, toks) == 0
    gate.go.set()
    assert store.drain(10) and store.lookup(keys, toks) == 2
    store.close()


def test_a_full_queue_drops_the_store_and_never_blocks_the_caller(tmp_path, monkeypatch):
    gate = _block_writer(monkeypatch)
    store = _open(tmp_path, max_queued_runs=2)
    runs = [_prompt(100 * i, 2) for i in range(4)]
    assert store.store_run(runs[0][0], None, runs[0][1], _payload(2)) == 2
    gate.entered.wait(5)  # the writer holds run 0; two more fit in the queue
    t0 = time.perf_counter()
    queued = [store.store_run(k, None, t, _payload(2)) for k, t in runs[1:]]
    assert time.perf_counter() - t0 < 1.0  # the disk is stuck; the caller is not
    assert queued == [2, 2, 0]
    s = store.stats()
    assert (s.dropped_writes, s.queued_writes, s.blocks) == (1, 2, 0)
    gate.go.set()
    assert store.drain(10)
    assert [store.lookup(k, t) for k, t in runs] == [2, 2, 2, 0]
    assert store.store_run(runs[3][0], None, runs[3][1], _payload(2)) == 2  # offered again
    assert store.drain(10) and store.lookup(*runs[3]) == 2
    store.close()


def test_a_byte_bound_on_the_queue_drops_too(tmp_path, monkeypatch):
    gate = _block_writer(monkeypatch)
    store = _open(tmp_path, max_queued_bytes=3 * BB)
    runs = [_prompt(100 * i, 2) for i in range(4)]
    store.store_run(runs[0][0], None, runs[0][1], _payload(2))
    gate.entered.wait(5)
    assert [store.store_run(k, None, t, _payload(2)) for k, t in runs[1:]] == [2, 0, 0]
    gate.go.set()
    store.close()


# ---- faults --------------------------------------------------------------------------------


def _assert_off(store: DiskKVStore, caplog, fragment: str) -> None:
    keys, toks = _prompt(0, 1)
    assert not store.enabled and fragment in store.stats().off_reason
    assert store.store_run(keys, None, toks, _payload(1)) == 0
    assert store.lookup(keys, toks) == 0 and store.read(keys, toks) is None
    offs = [r for r in caplog.records if "disk KV tier off" in r.getMessage()]
    assert len(offs) == 1 and fragment in offs[0].getMessage()


def test_a_file_where_the_directory_should_be_turns_the_store_off(tmp_path, caplog):
    (tmp_path / "kv").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = _open(tmp_path / "kv")
        _assert_off(store, caplog, str(tmp_path / "kv"))
    assert store.stats().errors == 1
    store.close()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod")
def test_a_read_only_directory_turns_the_store_off(tmp_path, caplog):
    (tmp_path / "kv").mkdir(mode=0o500)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = _open(tmp_path / "kv")
        _assert_off(store, caplog, "Permission denied")
    store.close()


def test_disk_full_turns_the_store_off_once_and_reports_its_keys_removed(
    tmp_path, monkeypatch, caplog
):
    store = _open(tmp_path)
    keys, toks = _prompt(0, 2)
    _put(store, keys, toks, _payload(2))
    store.drain_changes()

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_files, "write_durably", full)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in (1, 2):
            k, t = _prompt(100 * i, 1)
            store.store_run(k, None, t, _payload(1))  # never raises
            assert store.drain(10)
        _assert_off(store, caplog, "disk full")
    assert store.drain_changes() == [DiskRemoved(tuple(keys), "off")]
    s = store.stats()
    assert s.errors == 1 and s.usage_bytes == s.blocks == 0
    store.close()


def test_a_directory_removed_under_the_store_turns_it_off(tmp_path, caplog):
    store = _open(tmp_path / "kv")
    shutil.rmtree(tmp_path / "kv")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        keys, toks = _prompt(0, 1)
        store.store_run(keys, None, toks, _payload(1))
        assert store.drain(10)
        _assert_off(store, caplog, "is gone")
    store.close()


def test_no_budget_means_off_and_no_directory(tmp_path):
    store = _open(tmp_path / "kv", capacity=0)
    assert not store.enabled and not (tmp_path / "kv").exists()
    assert store.stats().off_reason.startswith("no budget")
    store.close()


# ---- admission -----------------------------------------------------------------------------


def test_admission_threshold_of_two_writes_a_block_the_second_time_it_is_offered(tmp_path):
    store = _open(tmp_path, admit_after=2)
    keys, toks = _prompt(0, 3)
    assert _put(store, keys[:2], toks[:2], _payload(2)) == 0
    assert store.stats().not_admitted == 2
    assert _put(store, keys, toks, _payload(3)) == 2  # keys 0, 1 seen twice; key 2 once
    assert store.lookup(keys, toks) == 2
    assert store.drain_changes() == [DiskRun(tuple(keys[:2]), None, tuple(toks[:2]))]
    assert _put(store, keys, toks, _payload(3)) == 1
    assert store.drain_changes() == [DiskRun((keys[2],), keys[1], (toks[2],))]
    store.close()


def test_admission_threshold_is_one_or_two(tmp_path):
    with pytest.raises(ValueError, match="admit_after=3"):
        _open(tmp_path, admit_after=3)


# ---- read or recompute ---------------------------------------------------------------------


def test_read_rate_is_an_ewma_of_timed_reads():
    rate = ReadRate(100.0, alpha=0.5)
    rate.observe(400, 2.0)  # 200 B/s
    assert rate.bytes_per_s == 150.0
    rate.observe(0, 1.0)  # nothing read: no sample
    assert rate.bytes_per_s == 150.0
    assert rate.seconds_for(300) == 2.0 and rate.seconds_for(0) == 0.0
    with pytest.raises(ValueError):
        ReadRate(0.0)


def test_load_estimate_scales_with_blocks_and_slow_reads_are_skipped(tmp_path):
    store = _open(tmp_path)
    assert store.rate.bytes_per_s > 0  # calibrated by the probe at open
    store.rate = ReadRate(BB * 100.0)  # 100 blocks/s
    assert store.estimated_load_seconds(10) == pytest.approx(0.1)
    assert store.should_read(10, recompute_seconds=0.5)
    assert not store.should_read(10, recompute_seconds=0.05)
    assert store.stats().skipped_reads == 1
    keys, toks = _prompt(0, 4)
    _put(store, keys, toks, _payload(4))
    before = store.rate.bytes_per_s
    store.read(keys, toks)  # a real read (from the page cache: far faster than 6.4 kB/s)
    assert store.rate.bytes_per_s > before
    store.close()


def test_calibration_at_open_times_the_scan_when_it_reads_enough(tmp_path):
    store = _open(tmp_path)
    keys, toks = _prompt(0, 8)
    _put(store, keys, toks, _payload(8))
    store.close()
    again = _open(tmp_path, probe_bytes=8 * BB)
    assert again.rate.bytes_per_s > 0 and not list(tmp_path.glob("*.tmp"))
    again.close()


# ---- concurrency ---------------------------------------------------------------------------


def _payload_of(keys) -> np.ndarray:
    """Bytes determined by each key, so any read can be checked."""
    return np.stack([np.resize(np.frombuffer(k, dtype=np.uint8), BB) for k in keys])


def test_concurrent_stores_reads_pins_and_discards_serve_only_right_bytes(tmp_path):
    size = _one_block_file_bytes(tmp_path)
    store = _open(tmp_path / "d", capacity=12 * size, max_blocks_per_file=2, max_queued_runs=4)
    prompts = [_prompt(1000 * i, 4) for i in range(12)]
    rng = np.random.default_rng(7)
    stop = threading.Event()
    failures: list[str] = []

    def reader() -> None:
        r = np.random.default_rng(8)
        while not stop.is_set():
            keys, toks = prompts[int(r.integers(len(prompts)))]
            a = int(r.integers(4))
            keys, toks = keys[a:], toks[a:]
            pin = store.pin(keys, toks)
            n = len(pin)
            got = store.read(keys[:n], toks[:n]) if n else None
            if got is not None and not np.array_equal(got, _payload_of(keys[:n])):
                failures.append("wrong bytes served")
            store.release(pin)
            if r.random() < 0.1:
                store.discard(keys[int(r.integers(4)) :][:1])

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(200):
            keys, toks = prompts[int(rng.integers(len(prompts)))]
            a = int(rng.integers(0, 4))
            store.store_run(keys[a:], keys[a - 1] if a else None, toks[a:], _payload_of(keys[a:]))
            if rng.random() < 0.2:
                store.check_invariants()
                store.drain(10)  # let the disk keep up now and then (most stores still queue)
        deadline = time.monotonic() + 10  # a loaded machine may not have run the reader yet
        while store.stats().reads == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        t.join(10)
    assert store.drain(10) and not failures
    store.check_invariants()
    s = store.stats()
    on_disk = _files(tmp_path / "d")
    assert s.usage_bytes == sum(p.stat().st_size for p in on_disk) <= 12 * size
    # (evictions depend on how many runs the reader discarded meanwhile: the LRU tests count them)
    assert s.files == len(on_disk) and s.writes > 12 and s.reads > 0
    for keys, toks in prompts:
        n = store.lookup(keys, toks)
        if n:
            assert np.array_equal(store.read(keys[:n], toks[:n]), _payload_of(keys[:n]))
    store.close()


def test_fingerprint_names_model_and_layout():
    a = fingerprint_of("m", KVLayout(16, 2, 2, 4, "float32"))
    assert a != fingerprint_of("m", KVLayout(16, 2, 2, 4, "bfloat16"))
    assert a != fingerprint_of("n", KVLayout(16, 2, 2, 4, "float32"))
