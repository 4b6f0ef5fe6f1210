"""The index names, per worker, the keys another live worker keeps (one keeper per key: the
lowest registry slot holding it), and the publisher hands them to the worker's pool."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvstore.blocks.hashing import BlockKey
from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from kvstore.index_types import WorkerLoad
from kvstore.publisher import WorkerPublisher
from tests.kvstore.helpers import Pool, chain, stored
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture
def index(redis_server: RedisServer) -> Iterator[KVIndex]:
    idx = KVIndex(IndexConfig(url=redis_server.url, model_id="m", heartbeat_ttl_s=5.0))
    yield idx
    idx.close()


def test_every_holder_but_the_lowest_live_slot_may_evict_its_copy(index: KVIndex) -> None:
    a, b, c = chain(2, 1), chain(2, 2), chain(2, 3)
    epochs = {w: index.register(w) for w in ("w0", "w1", "w2")}  # slots 0, 1, 2
    holds = {"w0": [a, b], "w1": [a, c], "w2": [a, b, c]}
    for w, chains in holds.items():
        assert not index.apply_events(w, epochs[w], 1, [stored(k) for k in chains]).needs_resync
    assert index.spare_keys("w0", epochs["w0"]) == set()  # the keeper of all it holds
    assert index.spare_keys("w1", epochs["w1"]) == set(a)
    assert index.spare_keys("w2", epochs["w2"]) == {*a, *b, *c}
    index.deregister("w0", epochs["w0"])  # gone: w1 keeps a and c now, w2 keeps b
    assert index.spare_keys("w1", epochs["w1"]) == set()
    assert index.spare_keys("w2", epochs["w2"]) == {*a, *c}
    assert index.spare_keys("w2", epochs["w2"] + 1) == set()  # a stale epoch: nothing


def test_the_publisher_hands_the_spares_to_its_worker(index: KVIndex) -> None:
    keeper, copy = Pool(), Pool()
    a, b = chain(2, 1), chain(2, 2)
    got: list[set[BlockKey]] = []
    pubs = [
        WorkerPublisher(index, "w0", keeper.list_cached_keys, purge_interval_s=None),
        WorkerPublisher(
            index,
            "w1",
            copy.list_cached_keys,
            purge_interval_s=None,
            on_spares=got.append,
            spares_interval_s=0.05,
        ),
    ]
    load = WorkerLoad(running=0, waiting=0, free_blocks=8, total_blocks=8, queued_prefill_tokens=0)
    pubs[0].submit(keeper.store(a), load)
    pubs[0].start()
    assert pubs[0].flush()
    pubs[1].submit(copy.store(a) + copy.store(b), load)
    pubs[1].start()
    try:
        deadline = time.monotonic() + 10
        while not (got and got[-1] == set(a)):
            assert time.monotonic() < deadline, f"spares never named a: {got}"
            pubs[1].submit([], load)  # a step: wakes the publisher's round
            time.sleep(0.05)
        assert pubs[1].stats.spare_refreshes >= 1
    finally:
        for pub in pubs:
            pub.stop()
