"""A worker whose engine loop dies takes itself down and Ray restarts it (issue 13).

One request's failure never stops the engine (tests/engine/test_poison.py); this is the last
line: an error the engine could not contain. The worker must not stay up with a dead loop
(every later request would fail): it deregisters, its process exits, Ray restarts the actor
under a new epoch, and requests queued on it are retried on the other worker meanwhile.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from tests.reliability.helpers import (
    CALL_TIMEOUT_S,
    RESTART_TIMEOUT_S,
    health_report,
    on_workers,
    wait_for,
    wait_idle,
)

# the restart it waits for may take RESTART_TIMEOUT_S on a loaded machine
pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(RESTART_TIMEOUT_S + 300)]
VICTIM = "worker-0"


def _break_engine(server) -> int:  # noqa: ANN001 - runs inside the worker actor
    """Make the worker's next engine step raise outside any request (state beyond repair),
    and give the loop a request of its own so that the step happens: the router may well
    send none of the test's requests to this worker (an idle loop never steps)."""
    from worker.engine import SamplingParams

    def step() -> list:
        raise RuntimeError("injected: engine state beyond repair")

    server.engine.step = step
    server.engine_loop.add_request([1, 2, 3, 4], SamplingParams(max_tokens=1))
    return server.index.epoch


def _epochs(client) -> dict[str, int]:  # noqa: ANN001
    return {w.worker_id: w.epoch for w in client.status().workers if w.alive}


def test_a_dead_engine_loop_restarts_the_worker(cluster, client) -> None:
    assert wait_for(lambda: VICTIM in _epochs(client), 60, 0.5)
    epoch0 = ray_call(cluster, _break_engine)
    outcomes: dict[int, object] = {}

    def send(i: int) -> None:
        try:
            out = client.generate(
                f"Question {i}: where does the KV cache live?",
                max_tokens=8,
                temperature=0.0,
                timeout=CALL_TIMEOUT_S,
            )
            outcomes[i] = ("OK", out.worker_id)
        except grpc.RpcError as exc:
            outcomes[i] = (exc.code(), exc.details())

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT_S + 10)
    assert len(outcomes) == 8, "a request hung"
    # none had produced a token on the victim: each was retried on the other worker
    assert all(o[0] == "OK" for o in outcomes.values()), outcomes
    # the victim left and came back under a new epoch (before: it stayed up, loop dead)
    assert wait_for(lambda: _epochs(client).get(VICTIM, 0) > epoch0, RESTART_TIMEOUT_S, 0.5), (
        health_report(cluster)
    )
    served = [
        client.generate(f"After the restart {i}.", max_tokens=2, timeout=CALL_TIMEOUT_S)
        for i in range(6)
    ]
    assert any(o.worker_id == VICTIM for o in served) or wait_for(
        lambda: (
            client.generate("One more.", max_tokens=2, timeout=CALL_TIMEOUT_S).worker_id == VICTIM
        ),
        30,
        0.2,
    )
    assert wait_idle(cluster)


def ray_call(cluster, fn):  # noqa: ANN001, ANN201
    return on_workers(cluster, lambda s: fn(s) if s.worker_id == VICTIM else None)[VICTIM]


def test_worker_processes_wait_passively(cluster) -> None:
    """OpenMP in every worker actor was told to sleep, not spin, before torch loaded (a
    spinning team collapses when another process takes a core: worker/cpu_threads.py)."""

    def policy(server) -> str | None:  # noqa: ANN001
        from worker import cpu_threads

        return cpu_threads.effective_wait_policy

    assert set(on_workers(cluster, policy).values()) == {"PASSIVE"}


def test_served_processes_run_at_normal_priority_with_their_engines_threads(cluster) -> None:
    """Workers and routers run at niceness 0 (workers.niceness / router.niceness), not
    Ray's 15, and each engine loop's thread runs its engine's intra-op threads."""
    import os

    import ray

    def probe(server) -> tuple[int, int, int]:  # noqa: ANN001
        from worker.engine.commands import ComputeThreads

        loop_threads = server.engine_loop.call(ComputeThreads())
        return os.nice(0), server.engine.cpu_threads, loop_threads

    for niceness, threads, loop_threads in on_workers(cluster, probe).values():
        assert niceness == 0 and loop_threads == threads >= 1
    routers = [h.__ray_call__.remote(lambda r: os.nice(0)) for h in cluster.routers.values()]
    assert set(ray.get(routers, timeout=CALL_TIMEOUT_S)) == {0}


MARK = (497, 498, 499, 496)  # prompts starting with these token ids hit the injected bug


def _inject_bug(server) -> None:  # noqa: ANN001 - runs inside each worker actor
    proc = server.engine.processor
    original = type(proc)._append

    def append(req, seq, tok, *rest) -> None:  # noqa: ANN001
        if tuple(req.prompt_ids[: len(MARK)]) == MARK and seq.num_output >= 2:
            raise ZeroDivisionError("injected bug hit by one request")
        original(proc, req, seq, tok, *rest)

    proc._append = append


def _remove_bug(server) -> None:  # noqa: ANN001
    server.engine.processor.__dict__.pop("_append", None)


def test_a_request_that_breaks_gets_internal_and_the_others_stream_on(cluster, client) -> None:
    on_workers(cluster, _inject_bug)
    try:
        outcomes: dict[str, object] = {}

        def send(name: str, prompt: list[int]) -> None:
            try:
                out = client.generate(
                    prompt, max_tokens=24, ignore_eos=True, temperature=0.0, timeout=CALL_TIMEOUT_S
                )
                outcomes[name] = ("OK", out.completion_tokens)
            except grpc.RpcError as exc:
                outcomes[name] = (exc.code(), exc.details())

        jobs = {f"ok-{i}": [10 + i, 20, 30, 40 + i] * 4 for i in range(4)}
        jobs["poison"] = [*MARK, 7, 8, 9]
        threads = [threading.Thread(target=send, args=kv) for kv in jobs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CALL_TIMEOUT_S + 10)
        code, details = outcomes["poison"]
        assert code == grpc.StatusCode.INTERNAL
        assert "ZeroDivisionError" in details and "injected bug" in details
        assert all(outcomes[f"ok-{i}"] == ("OK", 24) for i in range(4)), outcomes
        # every worker still serves (before: the bug ended the engine loop for good)
        for i in range(4):
            assert (
                client.generate(
                    [60 + i, 61, 62], max_tokens=4, ignore_eos=True, timeout=CALL_TIMEOUT_S
                ).completion_tokens
                == 4
            )
        assert wait_idle(cluster), "the failed request left blocks or requests behind"
    finally:
        on_workers(cluster, _remove_bug)
