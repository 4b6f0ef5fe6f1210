"""Small helpers shared by the engine tests."""

from __future__ import annotations

from worker.engine import Engine, GenerationResult


def run_all(engine: Engine, max_steps: int = 10_000) -> dict[str, GenerationResult]:
    """Step until every request finished; results by request id."""
    results: dict[str, GenerationResult] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return results
        for out in engine.step():
            results.setdefault(out.request_id, GenerationResult(out.request_id, [])).add(out)
    raise AssertionError(f"not finished after {max_steps} steps")


def assert_no_blocks_in_use(engine: Engine) -> None:
    engine.kv.check_invariants()
    stats = engine.kv.stats()
    assert stats.used_blocks == 0, stats
    assert stats.num_seqs == 0, stats
