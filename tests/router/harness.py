"""A tiny cluster for router tests: real KV managers, a real in-memory index fed by their
events, loads as token counters that the test drives."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.blocks.tiers import Tier
from kvstore.index_types import WorkerLoad
from router import InMemoryPrefixIndex, RouteDecision, Router, RouteRequest, RoutingConfig
from worker.kv import HashContext, KVCacheManager, KVEvent

NO_CTX = HashContext()


def load(
    queued: int = 0,
    decode: int = 0,
    free: int = 1000,
    running: int = 0,
    host: int = 0,
    total: int = 1000,
) -> WorkerLoad:
    """A worker's heartbeat load; ``host``: its host KV tier's size in blocks; ``total``:
    its device KV blocks."""
    return WorkerLoad(
        running=running,
        waiting=0,
        free_blocks=min(free, total),
        total_blocks=total,
        queued_prefill_tokens=queued,
        decode_tokens=decode,
        tier_blocks={Tier.HOST: host} if host else {},
    )


def tokens(tag: int, n: int) -> list[int]:
    """``n`` tokens that depend only on ``tag`` (distinct tags never share a block)."""
    return [(tag * 7919 + i * 31) % 50_000 + 1 for i in range(n)]


class MiniCluster:
    """``n`` workers "w0".."w{n-1}". A placed request is admitted at once (its blocks become
    cached and its uncached tokens join the worker's queue); ``drain`` serves queue."""

    def __init__(
        self,
        n: int,
        routing: RoutingConfig,
        *,
        deliver_events: bool = True,
        num_blocks: int = 4096,
        block_size: int = 16,
        reported_blocks: int = 1000,
    ) -> None:
        self.kv = {f"w{i}": KVCacheManager(num_blocks, block_size) for i in range(n)}
        self.queue = dict.fromkeys(self.kv, 0)
        self.index = InMemoryPrefixIndex()
        self.now = 0.0
        self.router = Router(routing, self.index, block_size=block_size, clock=lambda: self.now)
        self.deliver_events = deliver_events
        self.held: list[tuple[str, list[KVEvent]]] = []
        self.reported_blocks = reported_blocks  # the KV size the workers' loads report

    def loads(self) -> dict[str, WorkerLoad]:
        return {w: load(self.queue[w], total=self.reported_blocks) for w in self.kv}

    def place(self, rid: str, prompt: Sequence[int], ctx: HashContext = NO_CTX) -> RouteDecision:
        decision = self.router.route(RouteRequest(rid, prompt, ctx), self.loads())
        w = decision.worker_id
        kv = self.kv[w]
        hit = kv.lookup_prefix(prompt, ctx)
        alloc = kv.allocate_slots(rid, prompt, len(prompt) - hit.num_tokens, ctx=ctx, prefix=hit)
        assert alloc is not None
        kv.free(rid)
        self.queue[w] += len(prompt) - alloc.num_cached_tokens
        events = kv.drain_events()
        if self.deliver_events:
            self.index.apply(w, events)
        else:
            self.held.append((w, events))
        return decision

    def deliver(self) -> None:
        for w, events in self.held:
            self.index.apply(w, events)
        self.held.clear()

    def drain(self, n_tokens: int) -> None:
        for w in self.queue:
            self.queue[w] = max(0, self.queue[w] - n_tokens)
