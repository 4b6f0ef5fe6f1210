"""A prefix pulled from a peer is a copy the peer still holds: when the pool must evict,
it goes before the blocks this engine computed itself (children before parents, so the
cache stays prefix-closed); with plain LRU the older, computed prefix would go first."""

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


def test_a_pulled_copy_is_evicted_before_a_computed_prefix(model_dir) -> None:
    def engine(blocks: int) -> Engine:
        cfg = EngineConfig(block_size=BS, num_blocks=blocks, max_model_len=256)
        return Engine.from_model_dir(model_dir, cfg, model_id="tiny")

    src, dst = engine(64), engine(16)
    local, pulled, new = prompt(1, 70), prompt(2, 70), prompt(3, 150)
    dst.generate([local], ONE)  # computed here first (the older blocks): 4 cached
    src.generate([pulled], ONE)
    ctx = dst.hash_context(ONE)
    run = export_run(src, block_keys(pulled, BS, ctx), ctx)
    assert import_run(dst, run, pulled, ctx).blocks == 4
    assert (hit(dst, local), hit(dst, pulled)) == (64, 64)
    dst.generate([new], ONE)  # 10 blocks: the 8 never used, then 2 evicted
    assert hit(dst, local) == 64  # kept whole
    assert hit(dst, pulled) == 32  # lost its last two blocks, the tail first
    dst.kv.check_invariants()
    assert dst.snapshot().kv_used_blocks == 0
