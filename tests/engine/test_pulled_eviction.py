"""A prefix pulled from a peer is a copy the peer still holds: once the request it was
pulled for has run on it, when the pool must evict, it goes before the blocks this engine
computed itself (children before parents, so the cache stays prefix-closed); with plain LRU
the older, computed prefix would go first. Until then it is the newest block of the pool
(its request is still waiting for its turn): evicting it first would waste the pull."""

from __future__ import annotations

import random

import pytest

from worker.engine import Engine, EngineConfig, SamplingParams
from worker.engine.kv_pull import export_run, import_run
from worker.kv import block_keys
from worker.model.build_tiny import build_tiny_model

BS = 16
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("evict") / "llama", "llama")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def hit(e: Engine, p: list[int]) -> int:
    ctx = e.hash_context(ONE)
    return e.kv.lookup_prefix(p, ctx, block_keys(p, BS, ctx)).num_tokens


def engine(model_dir, blocks: int) -> Engine:
    cfg = EngineConfig(block_size=BS, num_blocks=blocks, max_model_len=256)
    return Engine.from_model_dir(model_dir, cfg, model_id="tiny")


def land(src: Engine, dst: Engine, p: list[int]) -> None:
    """Compute ``p`` on ``src`` and import its blocks into ``dst``."""
    src.generate([p], ONE)
    ctx = dst.hash_context(ONE)
    run = export_run(src, block_keys(p, BS, ctx), ctx)
    assert import_run(dst, run, p, ctx).blocks == 4


def test_a_used_pulled_copy_is_evicted_before_a_computed_prefix(model_dir) -> None:
    src, dst = engine(model_dir, 64), engine(model_dir, 16)
    local, pulled, new = prompt(1, 70), prompt(2, 70), prompt(3, 150)
    dst.generate([local], ONE)  # computed here first (the older blocks): 4 cached
    land(src, dst, pulled)
    assert (hit(dst, local), hit(dst, pulled)) == (64, 64)
    dst.generate([pulled], ONE)  # the request it was pulled for runs on it (a hit)
    dst.generate([new], ONE)  # 10 blocks: the 8 never used, then 2 evicted
    assert hit(dst, local) == 64  # kept whole
    assert hit(dst, pulled) == 32  # lost its last two blocks, the tail first
    dst.kv.check_invariants()
    assert dst.snapshot().kv_used_blocks == 0


def test_a_landed_copy_outlives_older_blocks_until_its_request_runs(model_dir) -> None:
    src, dst = engine(model_dir, 64), engine(model_dir, 16)
    local, pulled, new = prompt(1, 70), prompt(2, 70), prompt(3, 150)
    dst.generate([local], ONE)
    land(src, dst, pulled)  # its request has not run yet: plain LRU, the newest blocks
    dst.kv.check_invariants()
    dst.generate([new], ONE)  # 10 blocks: the 8 never used, then 2 evicted
    assert hit(dst, pulled) == 64  # kept whole for the request that pulled it
    assert hit(dst, local) == 32  # the older, computed prefix lost its tail
    dst.kv.check_invariants()
