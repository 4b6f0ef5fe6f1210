"""The pool's integrity checks hold under ``python -O`` (they are raises, not asserts).

Each misuse is run in a child interpreter started with ``-O`` (asserts stripped): it must
raise :class:`BlockPoolError` and leave the free queue, the ref counts and the cache map as
they were.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.blocks.hashing import BlockKey
from worker.kv.block_pool import BlockPool, BlockPoolError, KVBlock

ROOT = Path(__file__).resolve().parents[2]


def _key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 16)


def _state(pool: BlockPool) -> tuple:
    ids = [b.block_id for b in pool.free_queue]
    return (
        ids,
        len(pool.free_queue),
        [b.ref_cnt for b in pool.blocks],
        dict(pool.cached),
        pool.num_evictable,
    )


def _misuses() -> list[tuple[str, BlockPool, object]]:
    """(name, pool, misuse) for every guarded misuse; each pool is in a legal state."""
    cases = []
    empty = BlockPool(2, 1)
    empty.take_new(2)
    cases.append(("pop from an empty free queue", empty, lambda p: p.free_queue.popleft()))
    cases.append(("take_new beyond the free blocks", BlockPool(2, 1), lambda p: p.take_new(3)))
    cases.append(("take_new of a negative count", BlockPool(2, 1), lambda p: p.take_new(-1)))
    twice = BlockPool(3, 1)
    held = twice.take_new(1)
    twice.release(held)
    cases.append(("double release", twice, lambda p, b=held: p.release(b)))
    cached = BlockPool(3, 1)
    blk = cached.take_new(1)
    cached.cache_full_blocks(blk, [_key(1)], [(1,)], None)
    cases.append(
        (
            "double insert into the cache",
            cached,
            lambda p, b=blk: p.cache_full_blocks(b, [_key(2)], [(2,)], None),
        )
    )
    queued = BlockPool(3, 1)
    cases.append(
        ("double insert into the free queue", queued, lambda p: p.free_queue.append(p.blocks[0]))
    )
    cases.append(
        (
            "remove a block that is not queued",
            BlockPool(2, 1),
            lambda p: p.free_queue.remove(KVBlock(7)),
        )
    )
    return cases


def test_every_misuse_raises_and_leaves_the_pool_intact() -> None:
    for name, pool, misuse in _misuses():
        before = _state(pool)
        with pytest.raises(BlockPoolError):
            misuse(pool)  # type: ignore[operator]
        assert _state(pool) == before, name
    # still usable after the refusals
    pool = BlockPool(2, 1)
    with pytest.raises(BlockPoolError):
        pool.take_new(3)
    assert [b.block_id for b in pool.take_new(2)] == [0, 1]


def test_misuse_checks_survive_python_dash_O() -> None:
    code = (
        "import sys\n"
        "assert False  # stripped under -O: proves the flag took effect\n"
        "import tests.kv.test_pool_misuse as t\n"
        "t.test_every_misuse_raises_and_leaves_the_pool_intact()\n"
        "print('ok', sys.flags.optimize)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-O", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "ok 1"
