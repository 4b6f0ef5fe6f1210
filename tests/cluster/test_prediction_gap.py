"""One worker's index entries are corrupted in Redis: they claim prompts it never cached.
The router predicts hits there, the worker realises none; after a few misses the router asks
that worker to resync, and from then on its predictions match again."""

from __future__ import annotations

import pytest

from cluster.launcher import Cluster
from kvstore.index import KVIndex
from tests.reliability.helpers import wait_for
from worker.kv import HashContext, block_keys

pytestmark = [pytest.mark.ray, pytest.mark.redis]

VICTIM = "worker-0"
PROMPTS = [
    f"Forged entry {i}: a question nobody sent before about paged caches and routers, "
    f"asked in the voice of a {kind}."
    for i, kind in enumerate(
        ("pirate", "lawyer", "poet", "robot", "chef", "pilot", "nurse", "judge", "clown", "miner")
    )
]


def _forge(index: KVIndex, worker_id: str, keys: list[bytes]) -> None:
    """Record ``keys`` as held on the device by ``worker_id``'s current registration, behind the
    back of its publisher (as a lost removal or a hash mismatch would leave them): its slot goes
    into each key's ``blk:device`` value and the key into its ``held:device`` set (schema:
    kvstore/__init__.py)."""
    ns = index.config.namespace
    r = index.client
    slot = int(r.hget(ns + "reg", worker_id).split(b":")[0])
    mine = slot.to_bytes(2, "big")
    for key in keys:
        value = r.hget(ns + "blk:device", key) or b""
        slots = sorted({value[i : i + 2] for i in range(0, len(value), 2)} | {mine})
        r.hset(ns + "blk:device", key, b"".join(slots))
        r.sadd(ns + f"held:device:{slot}", key)


def test_corrupted_entries_are_detected_and_resynced(cluster: Cluster, client) -> None:
    index = KVIndex(cluster.index_config())
    assert wait_for(lambda: set(index.live_workers()) == set(cluster.workers))
    ctx = HashContext(cluster.model_id, None, None)
    bs = cluster.cfg.workers.engine.block_size
    keys = [block_keys(client.tokenize(p), bs, ctx) for p in PROMPTS]
    assert all(len(k) >= 3 for k in keys)
    _forge(index, VICTIM, [k for ks in keys for k in ks])
    assert all(index.lookup(k).get(VICTIM) == len(k) for k in keys)  # the index now lies
    before = client.status()
    (victim0,) = [w for w in before.workers if w.worker_id == VICTIM]

    served = []
    for i, prompt in enumerate(PROMPTS):
        out = client.generate(prompt, max_tokens=1, temperature=0.0, timeout=60)
        served.append((out.worker_id, out.cached_tokens))
        if i == 3:  # the verdict came after the 3rd miss; let its resync land
            assert wait_for(lambda: not any(index.lookup(k).get(VICTIM) for k in keys[5:]))

    after = client.status()
    (victim1,) = [w for w in after.workers if w.worker_id == VICTIM]
    # the forged prompts went to the victim (predicted hits) and missed...
    assert served[:3] == [(VICTIM, 0)] * 3, served
    assert victim1.prediction_misses - victim0.prediction_misses >= 3
    assert victim1.predicted_cached_tokens - victim0.predicted_cached_tokens >= 3 * 3 * bs
    # ... so the router asked that worker, and only it, to resync, once
    assert victim1.index_resyncs - victim0.index_resyncs == 1
    assert after.index_resyncs - before.index_resyncs == 1
    # healed within a bounded number of requests: the forged entries were gone before the
    # 6th prompt was sent (the wait above), and now the victim's entries are what it really
    # holds: the prompts it served, none of those served elsewhere
    held = index.held_keys(VICTIM)
    assert set(keys[0]) <= held
    assert not held & {
        k for (w, _), ks in zip(served, keys, strict=True) if w != VICTIM for k in ks
    }
    assert after.prediction_misses - before.prediction_misses <= 5
    index.close()
