"""Redis dies mid-load and comes back on the same port, empty.

While it is down every request is still served (routers fall back to Ray's worker list and
route by load); when it returns the workers register again (new epochs) and resync their
cached blocks, and prefix routing resumes: the prefix hit rate and the routers' "prefix"
decisions recover to what they were before the outage.
"""

from __future__ import annotations

import threading

import pytest

from cluster.client import KVClusterClient
from kvstore.index import KVIndex
from tests.reliability.helpers import CALL_TIMEOUT_S, decisions, generate_code, wait_for
from worker.kv import HashContext, block_keys

pytestmark = [pytest.mark.ray, pytest.mark.redis]

PREFIXES = [
    f"System prompt {i}: you are assistant number {i} of a cluster that caches "
    f"attention keys and values; answer in the voice of a {kind}. "
    for i, kind in enumerate(("pirate", "lawyer", "poet", "robot"))
]


def _round(client: KVClusterClient, tag: str, n: int = 8) -> tuple[float, list]:
    """n requests over the prefixes; their prefix hit rate (cached / prompt tokens)."""
    outs = [
        client.generate(
            PREFIXES[i % len(PREFIXES)] + f"{tag} question {i}?",
            max_tokens=2,
            temperature=0.0,
            timeout=CALL_TIMEOUT_S,
        )
        for i in range(n)
    ]
    return sum(o.cached_tokens for o in outs) / sum(o.prompt_tokens for o in outs), outs


def test_redis_outage_serves_everything_then_prefix_routing_recovers(cluster, client) -> None:
    index = KVIndex(cluster.index_config())
    ctx = HashContext(cluster.model_id, None, None)
    bs = cluster.cfg.workers.engine.block_size
    keys = [block_keys(client.tokenize(p), bs, ctx) for p in PREFIXES]
    for p in PREFIXES:
        client.generate(p + "warm up", max_tokens=1, timeout=CALL_TIMEOUT_S)
    assert wait_for(lambda: _prefixes_indexed(index, keys))
    epochs = {w: i.epoch for w, i in index.live_workers().items()}
    hit_before, _ = _round(client, "before")
    assert hit_before > 0.5

    # a steady load through both routers for the whole outage; it cycles over a few prompts so
    # it does not churn the (small) caches and evict the prefixes the last round measures
    clients = [KVClusterClient(e) for e in cluster.endpoints]
    codes: list = []
    stop = threading.Event()

    def load() -> None:
        i = 0
        while not stop.is_set():
            codes.append(
                generate_code(
                    clients[i % 2], f"During the outage {i % 4}.", max_tokens=2, temperature=0.0
                )
            )
            i += 1

    loader = threading.Thread(target=load)
    loader.start()
    assert wait_for(lambda: len(codes) >= 3, 30)  # the load runs
    cluster.redis.stop()
    served_before_stop = len(codes)
    assert wait_for(lambda: not client.status().index_available, 30, 0.1)
    outage = [
        generate_code(client, PREFIXES[i % 4] + f"outage {i}", max_tokens=2) for i in range(8)
    ]
    # the load keeps being served while Redis is down
    assert wait_for(lambda: len(codes) > served_before_stop + 3, 30), codes
    cluster.redis.start()
    # workers register again (new epochs) and resync what they hold
    assert wait_for(lambda: _epochs_after(index, epochs), 30, 0.2)
    assert wait_for(lambda: _prefixes_indexed(index, keys), 15)
    served_after_start = len(codes)
    assert wait_for(lambda: len(codes) >= served_after_start + 3, 30)  # and after it is back
    stop.set()
    loader.join(CALL_TIMEOUT_S + 10)
    for c in clients:
        c.close()

    assert len(codes) > served_before_stop + 3, "the load kept running through the outage"
    assert {c for c, _ in codes + outage} == {codes[0][0].OK}, codes + outage
    # (a Redis read that times out on a loaded machine opens the breaker for a moment)
    assert wait_for(lambda: client.status().index_available, 30, 0.2)

    d0 = decisions(cluster)
    hit_after, outs = _round(client, "after")
    d1 = decisions(cluster)
    assert d1["prefix"] - d0["prefix"] >= len(outs) // 2  # prefix routing resumed
    placed = [(o.worker_id, o.cached_tokens, o.prompt_tokens) for o in outs]
    assert hit_after >= 0.9 * hit_before, (hit_before, hit_after, placed, index.live_workers())
    index.close()


def _prefixes_indexed(index: KVIndex, keys: list) -> bool:
    """Some live worker holds every whole recorded block of each prefix, per the index."""
    k = index.config.record_every
    return all(max(index.lookup(ks).values(), default=0) >= len(ks) // k * k for ks in keys)


def _epochs_after(index: KVIndex, before: dict[str, int]) -> bool:
    live = index.live_workers()
    return set(live) == set(before) and all(live[w].epoch > e for w, e in before.items())
