"""Property tests of the KV manager with a host tier: the single-tier machine's rules (admit,
chunked prefill, decode, fork, CoW, twins, free, preempt, reset, tenant quotas) plus
preemption without offload, against simulated device *and* host slot arrays. The manager's
transfers (device -> host offloads, then host -> device loads) run before every copy-on-write
and write, as the engine runs them.

Checked after every step: no block lost or duplicated in either tier, ref counts and free
lists consistent, the host tier never over its size, no key in both tiers, every sequence
reads back its tokens (so a load can never bring back wrong KV), every host block holds its
recorded tokens, the per-tier key sets rebuilt from the event stream equal the manager's,
the device set is prefix-closed and so is the union of both tiers.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvstore.blocks.tiers import Tier
from tests.kv.test_properties import PICK, KVMachine
from worker.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager
from worker.kv.invariants import check_prefix_closed, record_parents


class HostTierMachine(KVMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 10),
        host_blocks=st.integers(1, 12),
        quota=st.sampled_from([None, None, None, 1, 3]),
    )
    def setup(self, block_size: int, num_blocks: int, host_blocks: int, quota: int | None) -> None:
        super().setup(block_size, num_blocks, True, quota)
        self.kv = KVCacheManager(
            num_blocks, block_size, tenant_quota_blocks=quota, host_num_blocks=host_blocks
        )
        self.host_mem: list[int | None] = [None] * (host_blocks * block_size)
        self.tier_index: dict[str, set[bytes]] = {"device": set(), "host": set()}
        take_copies = self.kv.take_copies

        def transfers_then_copies() -> list[tuple[int, int]]:
            self._run_transfers()
            return take_copies()

        self.kv.take_copies = transfers_then_copies  # type: ignore[method-assign]

    def _run_transfers(self) -> None:
        bs, mem, host = self.bs, self.mem, self.host_mem
        t = self.kv.take_transfers()
        for dev, h in t.to_host:
            event("offload")
            host[h * bs : (h + 1) * bs] = mem[dev * bs : (dev + 1) * bs]
        for h, dev in t.to_device:
            event("load back")
            mem[dev * bs : (dev + 1) * bs] = host[h * bs : (h + 1) * bs]

    @rule(i=PICK, chunk=st.integers(1, 16))
    def preempt_recompute(self, i: int, chunk: int) -> None:
        """Preemption that chose recompute: its blocks are dropped on eviction, not kept."""
        if not self.seqs:
            return
        sid = self._pick(i)
        tokens = self.seqs.pop(sid).tokens
        self.kv.free(sid, offload=False)
        self._admit(tokens, chunk, None)

    @invariant()
    def events_rebuild_the_cached_key_set(self) -> None:
        index = self.tier_index
        for ev in self.kv.drain_events():
            assert ev.seq == self.next_event_seq
            self.next_event_seq += 1
            record_parents(ev, self.parents)
            if isinstance(ev, BlockStored):
                assert index[ev.tier].isdisjoint(ev.keys)
                index[ev.tier].update(ev.keys)
            elif isinstance(ev, BlockRemoved):
                assert index[ev.tier].issuperset(ev.keys)
                index[ev.tier].difference_update(ev.keys)
            else:
                assert isinstance(ev, AllBlocksCleared)
                index["device"].clear()
                index["host"].clear()
        assert index["device"] == set(self.kv.cached_keys())
        assert index["host"] == set(self.kv.host_cached_keys())
        assert len(index["host"]) <= self.kv.stats().host_blocks
        assert index["device"].isdisjoint(index["host"]), "a key in both tiers"
        check_prefix_closed(index["device"], self.parents)
        check_prefix_closed(index["device"] | index["host"], self.parents)
        if index["host"]:
            event("host tier holds blocks")

    @invariant()
    def host_blocks_hold_their_tokens(self) -> None:
        self._run_transfers()  # pending offloads read device blocks nothing has overwritten
        bs = self.bs
        host = self.kv.tiers.get(Tier.HOST)
        assert host is not None
        for block in host.lru.values():
            slots = self.host_mem[block.block_id * bs : (block.block_id + 1) * bs]
            assert tuple(slots) == block.token_ids, f"host {block} holds other tokens"


HostTierMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_host_tier_properties = HostTierMachine.TestCase
