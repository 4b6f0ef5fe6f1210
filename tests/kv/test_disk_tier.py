"""The disk tier backend under the KV manager (pure Python, bytes simulated per key):
blocks flow device -> host -> disk and back with their exact bytes, a hit is read only when
reading beats recomputing, a restart announces only prefix-closed runs, a block that fails
its check at read time is recomputed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from kvstore.blocks.events import BlockStored
from kvstore.blocks.tiers import Tier
from worker.kv import HashContext, KVCacheManager, TierSpec, block_keys
from worker.kv.disk_format import SUFFIX
from worker.kv.disk_read_rate import ReadRate
from worker.kv.disk_store import DiskKVStore
from worker.kv.disk_tier import DiskTier

CTX = HashContext("m")
BB = 32  # payload bytes per block
A = list(range(1, 9))  # 4 blocks of 2
B = list(range(11, 19))
C = list(range(21, 29))


def _bytes(key: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(key, digest_size=BB).digest(), dtype=np.uint8)


class Sim:
    """A KV manager with host and disk tiers, and the bytes a runner would hold."""

    def __init__(self, path: Path, recompute_seconds=None, **store_kw: object) -> None:
        store_kw.setdefault("probe_bytes", 0)
        self.store = DiskKVStore(path, 1 << 20, fingerprint="fp", block_bytes=BB, **store_kw)
        self.kv = KVCacheManager(
            6,
            2,
            host_num_blocks=2,
            lower_tiers=[TierSpec("disk", 64, {"store": self.store})],
            recompute_seconds=recompute_seconds,
        )
        tier = self.kv.tiers.get(Tier.DISK)
        assert isinstance(tier, DiskTier)
        self.disk = tier
        self.device: dict[int, np.ndarray] = {}
        self.host: dict[int, np.ndarray] = {}

    def run(self, rid: str, prompt: list[int]) -> int:
        """Admit, compute and free one prompt; returns its cached tokens."""
        hit = self.kv.lookup_prefix(prompt, CTX)
        alloc = self.kv.allocate_slots(
            rid, prompt, len(prompt) - hit.num_tokens, ctx=CTX, prefix=hit
        )
        assert alloc is not None
        loaded = self.copies()
        for block in self.kv.pool.cached.values():
            if block.block_id in loaded:  # what a load brought back is this key's KV
                assert np.array_equal(self.device[block.block_id], _bytes(block.key))
            self.device[block.block_id] = _bytes(block.key)
        self.kv.free(rid)
        self.copies()
        assert self.store.drain(10)
        self.kv.take_transfers()  # announces what landed
        self.kv.check_invariants()
        return alloc.num_cached_tokens

    def copies(self) -> set[int]:
        t = self.kv.take_transfers()
        for _, src, _, dst in t.moves:
            self.disk.write_blocks([dst], self.host[src][None])
        for _, src, _, dst in t.stores:
            self.disk.write_blocks([dst], self.device[src][None])
        for dev, host in t.to_host:
            self.host[host] = self.device[dev]
        for host, dev in t.to_device:
            self.device[dev] = self.host[host]
        if t.loads:
            rows = self.disk.loaded_blocks([c[1] for c in t.loads])
            for (_, _, _, dev), row in zip(t.loads, rows, strict=True):
                self.device[dev] = row
        return {d for _, d in t.to_device} | {c[3] for c in t.loads}

    def tier(self, tier: Tier):
        return next(s for s in self.kv.stats().tiers if s.tier is tier)


def _fill(sim: Sim) -> None:
    """A, then B and C push A's blocks down through the host to disk."""
    for rid, prompt in (("a", A), ("b", B), ("c", C)):
        sim.run(rid, prompt + [99])


def test_blocks_reach_disk_on_eviction_and_load_back_with_their_bytes(tmp_path):
    sim = Sim(tmp_path)
    _fill(sim)
    a = block_keys(A, 2, CTX)
    assert all(k in sim.disk for k in a), "A went device -> host -> disk"
    assert sim.run("a2", A + [99]) == 8  # the whole prompt's blocks, most from disk
    disk = sim.tier(Tier.DISK)
    assert disk.hit_tokens >= 4 and disk.read_blocks >= 2 and disk.loaded_blocks >= 2, disk
    assert not any(k in sim.disk for k in a)  # exclusive: the device holds them now


def test_a_slow_read_is_left_to_recompute_and_a_fast_one_is_read(tmp_path):
    recompute = lambda n: n * 1e-3  # noqa: E731  (1 ms per token)
    slow = Sim(tmp_path / "slow", recompute)
    _fill(slow)
    slow.store.rate = ReadRate(1.0)  # 1 byte/s: reading a block takes 32 s
    cached = slow.run("a2", A + [99])
    disk = slow.tier(Tier.DISK)
    assert disk.hit_tokens == 0 and disk.skipped_reads > 0, disk
    assert cached == slow.tier(Tier.HOST).hit_tokens  # what the host held still loads

    fast = Sim(tmp_path / "fast", recompute)
    _fill(fast)
    fast.store.rate = ReadRate(1e12)
    assert fast.run("a2", A + [99]) == 8
    disk = fast.tier(Tier.DISK)
    assert disk.hit_tokens > 0 and disk.skipped_reads == 0, disk


def test_a_block_failing_its_check_at_read_time_is_recomputed(tmp_path):
    sim = Sim(tmp_path)
    _fill(sim)
    for f in tmp_path.iterdir():
        if f.name.endswith(SUFFIX):
            data = bytearray(f.read_bytes())
            data[-1] ^= 0xFF
            f.write_bytes(bytes(data))
    cached = sim.run("a2", A + [99])  # run() checks every loaded block's bytes
    disk = sim.tier(Tier.DISK)
    assert disk.failed_reads > 0 and disk.hit_tokens == 0, disk
    assert cached == sim.tier(Tier.HOST).hit_tokens


def test_a_restart_announces_only_prefix_closed_runs(tmp_path):
    sim = Sim(tmp_path, max_blocks_per_file=1)
    _fill(sim)
    parent = {k: b.parent for k, b in sim.disk.held.items()}
    closed = set()
    for key in parent:  # held on disk with every ancestor held on disk too
        chain = [key]
        while parent.get(chain[-1]) is not None and parent[chain[-1]] in parent:
            chain.append(parent[chain[-1]])
        if parent.get(chain[-1]) is None:
            closed.add(key)
    sim.store.close()
    a = block_keys(A, 2, CTX)
    again = Sim(tmp_path)
    stored = [k for e in again.kv.drain_events() if isinstance(e, BlockStored) for k in e.keys]
    assert closed and set(stored) == closed and set(again.disk.keys()) == closed
    held = closed
    # without the file of a parent, its descendants on disk are not announced
    first = min((i for i, k in enumerate(a) if k in held), default=None)
    assert first is not None
    from worker.kv.disk_format import run_file_name

    (tmp_path / run_file_name([a[first]])).unlink()
    again.store.close()
    third = Sim(tmp_path)
    assert not any(k in third.disk for k in a[first:])
    assert third.run("a2", A + [99]) >= 0  # served, recomputing what is not announced
