"""A CPU engine's thread demotes itself before its compute threads exist: the engine thread,
and the native attention pool's threads it starts, run ``compute_nice`` points nicer than the
process; without a policy they run as the process does."""

from __future__ import annotations

import threading

import pytest
import torch

from kvstore.blocks import threadsched
from kvstore.blocks.loop_sched import ThreadSchedConfig
from worker.attention import native
from worker.engine import Engine, EngineConfig, EngineLoop, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5 + i, 6, 7, 8] * (i + 1) for i in range(4)]


def pool_nices() -> set[int]:
    return {threadsched.nice(t.native_id) for t in threading.enumerate() if "kvc-attn" in t.name}


@pytest.mark.parametrize("sched", [ThreadSchedConfig(enabled=True, compute_nice=4), None])
def test_the_engine_thread_and_its_attention_pool_run_nicer(tiny_dir, sched) -> None:
    if native.load_kernels() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    base = threadsched.nice()
    try:
        engine = Engine.from_model_dir(tiny_dir, EngineConfig(num_blocks=64, cpu_threads=2))
        # the pool (the process's one, maybe left by another test), used from this thread:
        # its threads run at this thread's niceness
        native.resize_pool(2, fresh=True)
        engine.generate(PROMPTS, PARAMS)  # a batch of decodes: the pool splits them
        assert pool_nices() == {base}
        with EngineLoop(engine, sched=sched) as front:
            streams = [front.add_request(p, PARAMS) for p in PROMPTS]
            for out in streams:
                assert sum(len(d.token_ids) for o in out for d in o.outputs) == 6
            want = min(base + 4, 19) if sched is not None else base
            assert front.compute_nice == (want if sched is not None else None)
            assert front.thread_id is not None
            assert threadsched.nice(front.thread_id) == want
            assert pool_nices() == {want}  # a fresh pool, started by the engine thread
    finally:
        torch.set_num_threads(1)  # the package's one intra-op thread for later tests
    assert threadsched.nice() == base
