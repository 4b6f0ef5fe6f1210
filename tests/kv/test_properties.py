"""Property tests: random admit / chunked prefill / decode / fork / free / abort / preempt / reset
against a model that writes every token into a simulated physical slot array through the block
table (copy-on-write copies executed first) and reads it back.

After every step: the manager's own ``check_invariants()``, plus independent checks — every
block's ref count equals the number of block tables holding it, free + in use = total, no
referenced block in the free queue, each live sequence reads back exactly its tokens (so a
copy-on-write can never leak a sibling's write, nor a prefix hit serve wrong KV), every cached
block's slots hold its recorded tokens, the key set rebuilt from the event stream equals
the manager's cached keys, and that key set is PREFIX-CLOSED (every cached key's parent, as
the events name it, is cached too) — the invariant the Redis index's bisect lookup rests on.
``duplicate_prefill`` computes one prompt in two sequences at once, so the same blocks are
filled twice ("twins") and evicted in every order. ``claim`` / ``unclaim`` stand for
requests entering and leaving a waiting queue: their prompts' cached blocks queue behind
every unclaimed one (``check_invariants`` checks each free cached block's run), and the
claims always equal the count the model keeps.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from worker.kv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HashContext,
    KVCacheManager,
    KVCapacityError,
)
from worker.kv.invariants import check_prefix_closed, record_parents

PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5] * 10]
TOKENS = st.lists(st.integers(0, 3), max_size=6)
PICK = st.integers(0, 10**6)


class _Seq:
    def __init__(self, tokens: list[int], computed: int) -> None:
        self.tokens = tokens  # every known token: prompt + generated
        self.computed = computed  # tokens whose slots have been written


class KVMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 14),
        caching=st.sampled_from([True, True, True, False]),
        quota=st.sampled_from([None, None, 0, 1, 2, 4]),
    )
    def setup(self, block_size: int, num_blocks: int, caching: bool, quota: int | None) -> None:
        self.bs = block_size
        self.kv = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=caching, tenant_quota_blocks=quota
        )
        self.mem: list[int | None] = [None] * (num_blocks * block_size)
        self.seqs: dict[int, _Seq] = {}
        self.next_id = 0
        self.index: set[bytes] = set()  # keys rebuilt from the event stream
        self.parents: dict[bytes, bytes | None] = {}  # key -> parent, from BlockStored events
        self.next_event_seq = 0
        self.claimed: list[list] = []  # the key chains claimed, one per waiting "request"

    # ---- helpers ---------------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        kv, pool = self.kv, self.kv.pool
        return (
            {s: (kv.block_table(s), kv.num_computed_tokens(s)) for s in self.seqs},
            [(b.ref_cnt, b.key) for b in pool.blocks],
            [b.block_id for b in pool.free_queue],
            len(pool.events),
            kv.stats(),
        )

    def _pick(self, i: int) -> int:
        """A live sequence (rules that need one are no-ops while there is none)."""
        return sorted(self.seqs)[i % len(self.seqs)]

    def _allocate(self, sid: int, tokens: list[int], n: int, **kw) -> bool:
        before = self._snapshot()
        try:
            alloc = self.kv.allocate_slots(sid, tokens, n, **kw)
        except KVCapacityError:
            event("capacity error")
            seq = self.seqs.get(sid)
            base = seq.computed if seq else kw["prefix"].num_tokens
            assert -(-(base + n) // self.bs) > self.kv.num_blocks
            alloc = None
        if alloc is None:
            event("allocation refused")
            assert self._snapshot() == before, "failed allocation changed the pool"
            return False
        if alloc.num_cached_tokens:
            event("prefix hit adopted")
        seq = self.seqs.get(sid)
        if seq is None:
            seq = self.seqs[sid] = _Seq(tokens, alloc.num_cached_tokens)
        assert self.kv.num_computed_tokens(sid) == seq.computed + n
        for src, dst in self.kv.take_copies():  # copy-on-write before any write
            event("copy-on-write")
            self.mem[dst * self.bs : (dst + 1) * self.bs] = self.mem[
                src * self.bs : (src + 1) * self.bs
            ]
        table = self.kv.block_table(sid)
        for pos in range(seq.computed, seq.computed + n):
            self.mem[table[pos // self.bs] * self.bs + pos % self.bs] = tokens[pos]
        seq.computed += n
        return True

    def _admit(self, tokens: list[int], chunk: int, salt: str | None) -> None:
        ctx = HashContext("m", cache_salt=salt)
        hit = self.kv.lookup_prefix(tokens, ctx)
        assert hit.num_tokens <= len(tokens) - 1 and hit.num_tokens % self.bs == 0
        n = min(len(tokens) - hit.num_tokens, chunk)
        self._allocate(self.next_id, tokens, n, ctx=ctx, prefix=hit)
        self.next_id += 1

    # ---- rules -----------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=TOKENS,
        salt=st.sampled_from([None, "tenant"]),
        chunk=st.integers(1, 16),
    )
    def admit(self, prefix: list[int], tail: list[int], salt: str | None, chunk: int) -> None:
        self._admit((prefix + tail) or [0], chunk, salt)

    @rule(i=PICK, chunk=st.integers(1, 8), new=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def step(self, i: int, chunk: int, new: list[int]) -> None:
        """Continue a chunked prefill, or decode 1-3 tokens (speculative-style)."""
        if not self.seqs:
            return
        sid = self._pick(i)
        seq = self.seqs[sid]
        if seq.computed == len(seq.tokens):
            seq.tokens = seq.tokens + new
        n = min(chunk, len(seq.tokens) - seq.computed)
        self._allocate(sid, seq.tokens, n)

    @rule(
        prefix=st.sampled_from(PREFIXES[1:]),
        tail=TOKENS,
        first=st.integers(1, 3),
        chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8),
        finish=st.sampled_from([(), (0,), (1,), (0, 1), (1, 0)]),
    )
    def duplicate_prefill(
        self,
        prefix: list[int],
        tail: list[int],
        first: int,
        chunks: list[int],
        finish: tuple[int, ...],
    ) -> None:
        """Two sequences prefill the same prompt concurrently, in interleaved chunks, then
        ``finish`` frees some of them in that order (the next admits evict their blocks).

        Both are admitted before either fills a block, so neither hits the other's cache:
        every block both fill is computed twice (the second copy is a twin of the first).
        """
        tokens = prefix + tail
        sids = (self.next_id, self.next_id + 1)
        for _ in sids:
            self._admit(tokens, first, None)
        for turn, chunk in enumerate(chunks):
            sid = sids[turn % 2]
            seq = self.seqs.get(sid)
            if seq is not None and seq.computed < len(seq.tokens):
                self._allocate(sid, seq.tokens, min(chunk, len(seq.tokens) - seq.computed))
        if self.kv.pool.twins:
            event("twins")
        for i in finish:
            if sids[i] in self.seqs:
                self.kv.free(sids[i])
                del self.seqs[sids[i]]

    @rule(i=PICK)
    def fork(self, i: int) -> None:
        if not self.seqs:
            return
        parent = self.seqs[self._pick(i)]
        self.kv.fork(self._pick(i), self.next_id)
        self.seqs[self.next_id] = _Seq(parent.tokens[: parent.computed], parent.computed)
        self.next_id += 1

    @rule(i=PICK, a=st.integers(0, 3), b=st.integers(0, 3))
    def parallel_sampling(self, i: int, a: int, b: int) -> None:
        """Fork, then parent and child each decode a token (copy-on-write of a shared tail)."""
        if not self.seqs:
            return
        parent = self._pick(i)
        self.fork(i)
        for sid, tok in ((parent, a), (self.next_id - 1, b)):
            seq = self.seqs[sid]
            if seq.computed == len(seq.tokens):
                seq.tokens = seq.tokens + [tok]
                self._allocate(sid, seq.tokens, 1)

    @rule(i=PICK)
    def free_or_abort(self, i: int) -> None:
        if not self.seqs:
            return
        sid = self._pick(i)
        self.kv.free(sid)
        del self.seqs[sid]
        assert not self.kv.has_seq(sid)

    @rule(i=PICK, chunk=st.integers(1, 16))
    def preempt_and_readmit(self, i: int, chunk: int) -> None:
        if not self.seqs:
            return
        sid = self._pick(i)
        tokens = self.seqs.pop(sid).tokens
        self.kv.free(sid)
        self._admit(tokens, chunk, None)

    @rule(prefix=st.sampled_from(PREFIXES), tail=TOKENS, salt=st.sampled_from([None, "tenant"]))
    def claim(self, prefix: list[int], tail: list[int], salt: str | None) -> None:
        ctx = HashContext("m", cache_salt=salt)
        _, keys = self.kv.expected_prefix((prefix + tail) or [0], ctx, self.kv.claims)
        self.kv.claim(keys)
        self.claimed.append(keys)
        if any(self.kv.pool.cached.get(k) for k in keys):
            event("cached blocks claimed")

    @rule(i=PICK)
    def unclaim(self, i: int) -> None:
        if self.claimed:
            keys = self.claimed.pop(i % len(self.claimed))
            shared = self.kv.unclaim(keys)
            assert shared == any(k in self.kv.claims for k in keys)

    @rule()
    def reset(self) -> None:
        in_use = any(self.kv.block_table(s) for s in self.seqs)
        before = self.kv.cached_keys()
        ok = self.kv.reset_prefix_cache()
        assert ok == (not in_use)
        assert self.kv.cached_keys() == ([] if ok else before)

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def events_rebuild_the_cached_key_set(self) -> None:
        for ev in self.kv.drain_events():
            assert ev.seq == self.next_event_seq
            self.next_event_seq += 1
            record_parents(ev, self.parents)
            if isinstance(ev, BlockStored):
                assert len(ev.keys) == len(ev.token_ids) and ev.block_size == self.bs
                assert self.index.isdisjoint(ev.keys)
                self.index.update(ev.keys)
            elif isinstance(ev, BlockRemoved):
                assert self.index.issuperset(ev.keys)
                self.index.difference_update(ev.keys)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.index.clear()
        assert self.index == set(self.kv.cached_keys())
        check_prefix_closed(self.index, self.parents)

    @invariant()
    def pool_is_consistent(self) -> None:
        kv, pool = self.kv, self.kv.pool
        kv.check_invariants()
        holders = Counter(b for s in self.seqs for b in kv.block_table(s))
        assert all(b.ref_cnt == holders[b.block_id] for b in pool.blocks)
        queued = [b.block_id for b in pool.free_queue]
        assert not set(queued) & set(holders)
        assert len(queued) + len(holders) == kv.num_blocks == len(pool.blocks)
        assert kv.num_free_blocks() == len(queued) == kv.stats().free_blocks
        if kv.stats().tenant_quota_evictions:
            event("tenant quota evicted")
        assert kv.claims == Counter(k for keys in self.claimed for k in keys)

    @invariant()
    def every_sequence_reads_back_its_tokens(self) -> None:
        bs = self.bs
        for sid, seq in self.seqs.items():
            table = self.kv.block_table(sid)
            assert len(table) == -(-seq.computed // bs)
            got = [self.mem[table[p // bs] * bs + p % bs] for p in range(seq.computed)]
            assert got == seq.tokens[: seq.computed], f"seq {sid} reads back wrong tokens"
        for block in self.kv.pool.cached.values():
            slots = self.mem[block.block_id * bs : (block.block_id + 1) * bs]
            assert tuple(slots) == block.token_ids, f"cached {block} holds other tokens"


KVMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_manager_properties = KVMachine.TestCase
