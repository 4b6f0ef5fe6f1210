"""The host KV tier in the engine: loads back evicted prefixes, swap vs recompute preemption.

Exactness comes from the fake model (its "KV" is the token and position in each slot, read
back through the block table) and, for the real tiny Llama, from the engine without the tier:
a load that brought back the wrong block, or a copy run in the wrong order, changes tokens.
"""

from __future__ import annotations

import random

import pytest

from kvstore.blocks.tiers import Tier
from tests.engine.fakes import FakeExecutor, reference_generate
from tests.engine.helpers import assert_no_blocks_in_use, run_all
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.metrics import EngineMetrics
from worker.kv import TierTransfers


class HostFakeExecutor(FakeExecutor):
    """The fake model with host slots: swaps copy tokens and positions between tiers."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int) -> None:
        super().__init__(num_blocks, block_size)
        self.num_host_blocks = num_host_blocks
        n = num_host_blocks * block_size
        self.host_token, self.host_pos = [-1] * n, [-1] * n
        self.num_swaps = 0

    def swap(self, transfers: TierTransfers) -> None:
        bs = self.block_size
        self.num_swaps += 1
        for dev, host in transfers.to_host:
            self.host_token[host * bs : (host + 1) * bs] = self.slot_token[
                dev * bs : (dev + 1) * bs
            ]
            self.host_pos[host * bs : (host + 1) * bs] = self.slot_pos[dev * bs : (dev + 1) * bs]
            self.slot_token[dev * bs : (dev + 1) * bs] = [-2] * bs  # a stale read would show
        for host, dev in transfers.to_device:
            self.slot_token[dev * bs : (dev + 1) * bs] = self.host_token[
                host * bs : (host + 1) * bs
            ]
            self.slot_pos[dev * bs : (dev + 1) * bs] = self.host_pos[host * bs : (host + 1) * bs]


def make(num_blocks: int, host_blocks: int, bs: int = 4, **cfg) -> tuple[Engine, FakeExecutor]:
    ex = (
        HostFakeExecutor(num_blocks, bs, host_blocks)
        if host_blocks
        else FakeExecutor(num_blocks, bs)
    )
    cfg.setdefault("max_model_len", 256)
    return Engine(ex, EngineConfig(block_size=bs, **cfg)), ex


def shared_prefix_prompts(n_prefixes: int, per: int, prefix_len: int, seed: int) -> list[list[int]]:
    """``per`` rounds over ``n_prefixes`` long prefixes, each with a short distinct tail."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 64) for _ in range(prefix_len)] for _ in range(n_prefixes)]
    return [p + [rng.randrange(2, 64) for _ in range(3)] for _ in range(per) for p in prefixes]


def host_hits(metrics: EngineMetrics) -> int:
    """Prompt tokens the engine loaded back from its host tier."""
    host = metrics.tiers.get(Tier.HOST)
    return 0 if host is None else host.hit_tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefixes_larger_than_the_device_come_back_from_host(seed: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ps = shared_prefix_prompts(4, 3, 40, seed)  # 4 x 10 blocks of prefix, device holds 24
    results = {}
    for host in (0, 64):
        engine, ex = make(24, host, max_num_seqs=2, max_num_batched_tokens=64)
        outs = engine.generate(ps, params)
        for p, res in zip(ps, outs, strict=True):
            assert res.completions[0].token_ids == reference_generate(p, 6, ignore_eos=True)
        assert_no_blocks_in_use(engine)
        results[host] = (engine.metrics(), outs)
    off, on = results[0][0], results[64][0]
    assert host_hits(off) == 0 and host_hits(on) > 0, on
    assert on.computed_tokens < off.computed_tokens, (on.computed_tokens, off.computed_tokens)
    host_usage = [r.usage.host_cached_tokens for r in results[64][1]]
    assert sum(host_usage) == host_hits(on)
    assert all(u.usage.host_cached_tokens <= u.usage.cached_tokens for u in results[64][1])


def test_host_tier_keeps_tenants_apart() -> None:
    engine, _ = make(12, 64)
    p = [random.Random(9).randrange(2, 64) for _ in range(40)]
    flood = [[7 + i] * 41 for i in range(3)]
    a = SamplingParams(temperature=0, max_tokens=2, cache_salt="a")
    engine.generate([p], a)
    engine.generate(flood, SamplingParams(temperature=0, max_tokens=2))  # evicts p to host
    other = engine.generate([p], SamplingParams(temperature=0, max_tokens=2, cache_salt="b"))
    same = engine.generate([p], a)
    assert other[0].usage.cached_tokens == 0
    assert same[0].usage.host_cached_tokens > 0


def _pressure(mode: str, seed: int) -> tuple[Engine, dict, list[list[int]]]:
    engine, _ = make(
        28,
        128,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        preemption_mode=mode,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rng = random.Random(seed)
    ps = [[rng.randrange(2, 64) for _ in range(rng.randint(20, 36))] for _ in range(6)]
    ids = [engine.add_request(p, params) for p in ps]
    results = run_all(engine)
    for rid, p in zip(ids, ps, strict=True):
        assert results[rid].completions[0].token_ids == reference_generate(p, 24, ignore_eos=True)
    assert_no_blocks_in_use(engine)
    return engine, results, ps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swap_and_recompute_preemption_give_identical_outputs(seed: int) -> None:
    swap, _, _ = _pressure("swap", seed)
    recompute, _, _ = _pressure("recompute", seed)
    s, r = swap.metrics(), recompute.metrics()
    assert s.num_preemptions > 0 and r.num_preemptions > 0
    assert s.num_swap_preemptions == s.num_preemptions and r.num_swap_preemptions == 0
    assert s.recomputed_tokens < r.recomputed_tokens, (s.recomputed_tokens, r.recomputed_tokens)


def test_auto_mode_swaps_when_loading_is_cheaper() -> None:
    engine, _, _ = _pressure("auto", 0)
    m = engine.metrics()
    assert m.num_preemptions > 0 and m.num_swap_preemptions == m.num_preemptions


def test_preempted_request_is_not_preempted_again_before_progress() -> None:
    engine, _ = make(
        20,
        128,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        preemption_mode="swap",
    )
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    rng = random.Random(5)
    for i in range(6):
        engine.add_request([rng.randrange(2, 64) for _ in range(24)], params, request_id=str(i))
    scheduled = []
    schedule = engine.scheduler.schedule

    def recording_schedule():  # noqa: ANN202
        scheduled.append(schedule())
        return scheduled[-1]

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    waiting_for_progress: set[str] = set()
    resumes = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        sched = scheduled[-1]
        for rid in sched.preempted:
            assert rid not in waiting_for_progress, f"{rid} preempted again without progress"
            waiting_for_progress.add(rid)
        for out in outs:
            if any(d.token_ids for d in out.outputs):
                waiting_for_progress.discard(out.request_id)
        resumes += len(sched.resumed)
    assert resumes > 0 and engine.metrics().num_preemptions > 0


def test_swaps_run_even_in_a_step_without_model_work() -> None:
    """Transfers taken by a schedule with no chunks still run (a host block awaits its data)."""
    engine, ex = make(12, 32)
    assert isinstance(ex, HostFakeExecutor)
    p = list(range(2, 43))
    engine.generate([p], SamplingParams(temperature=0, max_tokens=2))
    engine.generate([[9] * 41], SamplingParams(temperature=0, max_tokens=2))  # evicts p
    before = ex.num_swaps
    assert engine.generate([p], SamplingParams(temperature=0, max_tokens=2))[
        0
    ].usage.host_cached_tokens
    assert ex.num_swaps > before


# ---- the real tiny Llama ------------------------------------------------------------------


def _real(tiny_dir, host_kv_bytes: int, mode: str) -> Engine:
    cfg = EngineConfig(
        num_blocks=12,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        host_kv_bytes=host_kv_bytes,
        preemption_mode=mode,
    )
    return Engine.from_model_dir(tiny_dir, cfg)


def test_real_model_outputs_identical_with_tier_on_and_off(tiny_dir) -> None:
    rng = random.Random(3)
    prefixes = [[rng.randrange(5, 512) for _ in range(70)] for _ in range(3)]
    ps = [pre + [rng.randrange(5, 512) for _ in range(4)] for _ in range(2) for pre in prefixes]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    runs = {}
    for host, mode in ((0, "recompute"), (1 << 22, "swap"), (1 << 22, "recompute")):
        engine = _real(tiny_dir, host, mode)
        outs = engine.generate(ps, params)
        runs[(host, mode)] = ([o.completions[0].token_ids for o in outs], engine.metrics())
        assert_no_blocks_in_use(engine)
    base = runs[(0, "recompute")][0]
    for key, (tokens, _) in runs.items():
        assert tokens == base, key
    swapped = runs[(1 << 22, "swap")][1]
    assert swapped.num_preemptions > 0 and host_hits(swapped) > 0, swapped


def test_host_tier_needs_prefix_caching() -> None:
    with pytest.raises(ValueError, match="host_kv_bytes=1024 needs enable_prefix_caching"):
        EngineConfig(host_kv_bytes=1024, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="sometimes")
