"""Block runs between engines: a pulled prefix gives the tokens a recomputed one gives, every
family, into the device cache or the host tier; forged runs are refused before a byte is
used; neither side keeps a ref."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from kvstore.blocks.events import BlockStored
from kvstore.blocks.tiers import Tier
from tests.engine.helpers import assert_no_blocks_in_use
from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.kv_pull import export_run, import_run
from worker.kv import HashContext, block_keys
from worker.kv.transfer import BlockRun, ImportRefused
from worker.model.build_tiny import FAMILIES, build_tiny_model

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pull-models")
    return {f: build_tiny_model(root / f, f) for f in FAMILIES}


def engine(path: Path, *, host_blocks: int = 0, num_blocks: int = 64, **cfg) -> Engine:
    probe = cfg.pop("_bytes_per_block", None)
    host_bytes = host_blocks * probe if host_blocks else 0
    return Engine.from_model_dir(
        path,
        EngineConfig(block_size=BS, num_blocks=num_blocks, host_kv_bytes=host_bytes, **cfg),
        model_id="tiny",
    )


def host_engine(path: Path, host_blocks: int, **cfg) -> Engine:
    e = engine(path, **cfg)
    per_block = e.executor.runner.bytes_per_block
    return engine(path, host_blocks=host_blocks, _bytes_per_block=per_block, **cfg)


def prompt(seed: int, n: int = 75) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def tokens(e: Engine, p: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    res = e.generate([p], params)[0]
    return res.completions[0].token_ids, res.usage.cached_tokens


def pulled(src: Engine, p: list[int], params: SamplingParams = GREEDY) -> BlockRun:
    ctx = src.hash_context(params)
    run = export_run(src, block_keys(p, BS, ctx), ctx)
    assert run is not None
    return run


@pytest.mark.parametrize("tier", [Tier.DEVICE, Tier.HOST, None])
@pytest.mark.parametrize("family", FAMILIES)
def test_pulled_prefix_gives_the_recomputed_tokens(family_dirs, family: str, tier) -> None:
    path = family_dirs[family]
    p = prompt(1)
    src = engine(path)
    want, _ = tokens(src, p)  # computes p on the source and caches its 4 full blocks
    run = pulled(src, p)
    assert len(run.header) == (len(p) - 1) // BS == 4
    assert_no_blocks_in_use(src)  # the export's pins are gone

    dst = host_engine(path, 8) if tier != Tier.DEVICE else engine(path)
    ctx = dst.hash_context(GREEDY)
    dst.drain_kv_events()
    res = import_run(dst, run, p, ctx, tier=tier)
    assert res.blocks == 4 and res.hit_tokens == 64
    assert res.tier == (Tier.HOST if tier == Tier.HOST else Tier.DEVICE)
    stored = [e for e in dst.drain_kv_events() if isinstance(e, BlockStored)]
    assert [k for e in stored for k in e.keys] == list(run.header.keys)
    assert {e.tier for e in stored} == {res.tier}
    assert_no_blocks_in_use(dst)
    got, cached = tokens(dst, p)
    assert got == want and cached == 64
    assert dst.metrics().computed_tokens == len(p) - 64 + GREEDY.max_tokens - 1
    assert_no_blocks_in_use(dst)


def test_only_the_missing_tail_is_written_and_a_gap_is_not(family_dirs) -> None:
    path = family_dirs["llama"]
    p = prompt(2, 120)  # 7 usable blocks
    src = engine(path)
    want, _ = tokens(src, p)
    dst = engine(path)
    tokens(dst, p[:40])  # dst caches blocks 0-1 itself
    ctx = dst.hash_context(GREEDY)
    res = import_run(dst, pulled(src, p), p, ctx)
    assert res.blocks == 5 and res.hit_tokens == 112
    # a run starting past what dst holds leaves a gap: nothing imported
    gap_dst = engine(path)
    keys = block_keys(p, BS, ctx)
    tail = export_run(src, keys[3:], ctx, start=3)
    assert tail is not None and tail.header.start == 3
    assert import_run(gap_dst, tail, p, ctx).blocks == 0
    assert gap_dst.kv.stats().cached_blocks == 0
    assert tokens(dst, p) == (want, 112)
    for e in (src, dst, gap_dst):
        assert_no_blocks_in_use(e)


def test_export_of_keys_not_held_or_of_another_context_is_empty(family_dirs) -> None:
    path = family_dirs["llama"]
    p = prompt(3)
    src = engine(path)
    tokens(src, p)
    ctx = src.hash_context(GREEDY)
    assert export_run(src, block_keys(prompt(4), BS, ctx), ctx) is None
    salted = HashContext("tiny", None, "tenant-b")  # keys of tenant a, claimed for tenant b
    assert export_run(src, block_keys(p, BS, ctx), salted) is None
    assert_no_blocks_in_use(src)


def _forge(run: BlockRun, **header) -> BlockRun:
    return BlockRun(dataclasses.replace(run.header, **header), run.payload)


def forgeries(run: BlockRun) -> dict[str, BlockRun]:
    h = run.header
    toks = list(h.token_ids)
    toks[2] = (toks[2][0] + 1, *toks[2][1:])
    data = np.array(run.payload.data)
    data[1, 0, 0, 5] ^= 0xFF
    return {
        "token ids differ": _forge(run, token_ids=tuple(toks)),
        "key differs": _forge(run, keys=(h.keys[0], h.keys[0], *h.keys[2:])),
        "salt differs": _forge(run, ctx=dataclasses.replace(h.ctx, cache_salt="other")),
        "adapter differs": _forge(run, ctx=dataclasses.replace(h.ctx, lora_id="a@1")),
        "model differs": _forge(run, ctx=dataclasses.replace(h.ctx, model_id="other")),
        "layout differs": _forge(run, layout=dataclasses.replace(h.layout, dtype="bfloat16")),
        "checksum mismatch": BlockRun(h, dataclasses.replace(run.payload, data=data)),
        "payload is": BlockRun(h, dataclasses.replace(run.payload, data=data[:2].copy())),
        "not a block run": "pickled garbage",  # type: ignore[dict-item]
        "not full blocks": _forge(run, start=1),
    }


def test_forged_runs_are_refused_and_change_nothing(family_dirs) -> None:
    path = family_dirs["llama"]
    p = prompt(5)
    src = engine(path)
    tokens(src, p)
    run = pulled(src, p)
    dst = engine(path)
    ctx = dst.hash_context(GREEDY)
    for reason, forged in forgeries(run).items():
        with pytest.raises(ImportRefused, match=reason):
            import_run(dst, forged, p, ctx)
        assert dst.kv.stats().cached_blocks == 0 and not dst.drain_kv_events(), reason
    # another tenant's request never takes tenant a's run, even a genuine one
    salted = dataclasses.replace(GREEDY, cache_salt="tenant-b")
    with pytest.raises(ImportRefused, match="salt differs"):
        import_run(dst, run, p, dst.hash_context(salted))
    other = engine(family_dirs["qwen3"])  # other head_dim: a foreign model's run
    with pytest.raises(ImportRefused, match="layout differs"):
        import_run(other, run, p, other.hash_context(GREEDY))
    assert_no_blocks_in_use(dst)


def test_import_evicting_cached_blocks_offloads_them_first(family_dirs) -> None:
    """A full device pool: the import's blocks evict LRU ones, whose offload to the host tier
    must run before the import overwrites them (their tokens come back intact)."""
    path = family_dirs["mistral"]
    a, b = prompt(6, 100), prompt(7, 100)  # 6 usable blocks each
    src = engine(path)
    want_b, _ = tokens(src, b)
    dst = host_engine(path, 16, num_blocks=8)
    want_a, _ = tokens(dst, a)  # a's 6 blocks fill most of dst's device pool
    ctx = dst.hash_context(GREEDY)
    res = import_run(dst, pulled(src, b), b, ctx, tier=Tier.DEVICE)
    assert res.blocks == 6
    assert dst.kv.stats().host_cached_blocks >= 4  # a's blocks went to the host tier
    assert tokens(dst, b) == (want_b, 96)
    got_a, cached_a = tokens(dst, a)
    assert got_a == want_a and cached_a == 96
    assert_no_blocks_in_use(dst)
