"""Bisect lookup == scan lookup == the truth, on indices published by real KV managers.

Several "workers", each a real :class:`KVCacheManager` with a small pool, run a random
shared-prefix workload (system prompts, documents, user tails; chunked prefill, decode,
preemption, concurrent prefill of one prompt by two sequences, so twins and evictions happen)
and publish their events to a real Redis. After every round, every prompt seen so far (and
some extensions) is looked up in both modes; both must return, for every worker, the leading
blocks its own cache holds (rounded down to ``record_every``), and every worker's cache must
be prefix-closed (twins included). A superseded registration that is half purged (its
entries are no longer prefix-closed) must not disturb bisect either.
"""

from __future__ import annotations

import random

import pytest

from kvstore.config import IndexConfig
from kvstore.index import KVIndex
from tests.redis_server import RedisServer
from worker.kv import BlockRemoved, BlockStored, HashContext, KVCacheManager, block_keys
from worker.kv.invariants import check_prefix_closed, record_parents

pytestmark = pytest.mark.redis

CTX = HashContext("m")


class _Worker:
    """One simulated engine: a real KV manager, its running sequences, its publisher state."""

    def __init__(self, name: str, num_blocks: int, block_size: int, index: KVIndex) -> None:
        self.name = name
        self.kv = KVCacheManager(num_blocks, block_size)
        self.seqs: dict[int, list[int]] = {}  # seq id -> its prompt
        self.index = index
        self.epoch = index.register(name)
        self.batch = 0
        self.parents: dict[bytes, bytes | None] = {}
        self.evicted = 0  # keys evicted so far (BlockRemoved)
        self.twins = 0  # twins seen after each step

    def admit(self, sid: int, prompt: list[int], chunk: int) -> None:
        hit = self.kv.lookup_prefix(prompt, CTX)
        n = min(chunk, len(prompt) - hit.num_tokens)
        if self.kv.allocate_slots(sid, prompt, n, ctx=CTX, prefix=hit) is not None:
            self.seqs[sid] = prompt

    def advance(self, sid: int, chunk: int, rng: random.Random) -> None:
        """Prefill the next chunk, or decode one token; preempt the sequence if it does not fit."""
        tokens = self.seqs[sid]
        done = self.kv.num_computed_tokens(sid)
        if done == len(tokens):
            tokens.append(rng.randrange(50))
        if self.kv.allocate_slots(sid, tokens, min(chunk, len(tokens) - done)) is None:
            self.free(sid)

    def free(self, sid: int) -> None:
        self.kv.free(sid)
        del self.seqs[sid]

    def publish(self) -> None:
        events = self.kv.drain_events()
        for event in events:
            record_parents(event, self.parents)
            if isinstance(event, BlockRemoved):
                self.evicted += len(event.keys)
        self.twins += sum(len(t) for t in self.kv.pool.twins.values())
        self.batch += 1
        assert self.index.apply_events(self.name, self.epoch, self.batch, events).applied
        check_prefix_closed(set(self.kv.cached_keys()), self.parents)

    def leading(self, keys: list[bytes], k: int) -> int:
        cached = set(self.kv.cached_keys())
        n = 0
        while n < len(keys) and keys[n] in cached:
            n += 1
        return n // k * k


def _prompts(rng: random.Random) -> list[list[int]]:
    """Prompts sharing prefixes: system prompt + document + tail, of 0-40 blocks of 2 tokens."""
    systems = [[rng.randrange(50) for _ in range(rng.randrange(0, 24))] for _ in range(3)]
    docs = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(5)]
    prompts = []
    for _ in range(24):
        tail = [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        prompts.append(rng.choice(systems) + rng.choice(docs) + tail)
    return prompts


def _round(workers: list[_Worker], prompts: list[list[int]], rng: random.Random, sid: int) -> int:
    """One engine step on every worker; returns the next free sequence id."""
    for w in workers:
        for _ in range(rng.randrange(3)):
            prompt = list(rng.choice(prompts))
            if rng.random() < 0.3:  # the same prompt twice, admitted before either fills a block
                w.admit(sid, list(prompt), 1)
                sid += 1
            w.admit(sid, prompt, rng.randrange(1, 12))
            sid += 1
        for s in list(w.seqs):
            if rng.random() < 0.15:
                w.free(s)
            else:
                w.advance(s, rng.randrange(1, 16), rng)
        w.publish()
    return sid


@pytest.mark.parametrize("record_every", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bisect_equals_scan_equals_truth_on_real_kv_managers(
    redis_server: RedisServer, record_every: int, seed: int
) -> None:
    rng = random.Random(seed)
    make = lambda mode: KVIndex(  # noqa: E731
        IndexConfig(url=redis_server.url, model_id="m", record_every=record_every, lookup=mode)
    )
    scan, bisect = make("scan"), make("bisect")
    workers = [_Worker(f"w{i}", rng.randrange(24, 64), 2, scan) for i in range(5)]
    prompts = _prompts(rng)
    sid, agreed, partial = 0, 0, 0
    for _ in range(30):
        sid = _round(workers, prompts, rng, sid)
        for prompt in prompts + [p + [rng.randrange(50)] * 6 for p in prompts[:6]]:
            keys = block_keys(prompt, 2, CTX)
            truth = {w.name: w.leading(keys, record_every) for w in workers}
            assert scan.lookup(keys) == truth
            assert bisect.lookup(keys) == truth
            agreed += 1
            partial += sum(0 < c < len(keys) // record_every * record_every for c in truth.values())
    # the workload did exercise what bisect has to get right: partial hits (breakpoints),
    # evictions under pressure and blocks computed twice (twins)
    assert agreed == 30 * 30 and partial > 100, partial
    assert sum(w.evicted for w in workers) > 100 and sum(w.twins for w in workers) > 0
    scan.close()
    bisect.close()


def test_half_purged_dead_registration_does_not_disturb_bisect(redis_server: RedisServer) -> None:
    """A dead slot's entries are purged in random chunks, so for a while they have holes;
    bisect counts only live candidates, so those holes cannot shift a live worker's count."""
    cfg = IndexConfig(url=redis_server.url, model_id="m")
    scan, bisect = KVIndex(cfg.model_copy(update={"lookup": "scan"})), KVIndex(cfg)
    keys = block_keys(list(range(200)), 2, CTX)  # 100 blocks
    old = scan.register("a")
    assert scan.apply_events("a", old, 1, [_stored(keys)]).applied
    new = scan.register("a")  # restart: the old slot is dead, not yet purged
    assert scan.resync("a", new, 1, keys[:60])
    eb = scan.register("b")
    assert scan.resync("b", eb, 1, keys[:30])
    slot, record = scan._run("PURGE_SCAN", 8)
    left = scan._run("PURGE_SLOT", slot, record, 45)  # about half of the dead slot's entries
    assert 0 < left < 100
    assert scan.lookup(keys) == bisect.lookup(keys) == {"a": 60, "b": 30}
    assert bisect.lookup(keys[:45]) == {"a": 45, "b": 30}
    scan.close()
    bisect.close()


def _stored(keys: list[bytes]) -> BlockStored:
    return BlockStored(0, tuple(keys), None, (), 2)
