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

from tests.reliability.helpers import CALL_TIMEOUT_S, on_workers, wait_for, wait_idle

pytestmark = [pytest.mark.ray, pytest.mark.redis]
VICTIM = "worker-0"


def _break_engine(server) -> int:  # noqa: ANN001 - runs inside the worker actor
    """Make the worker's next engine step raise outside any request (state beyond repair)."""

    def step() -> list:
        raise RuntimeError("injected: engine state beyond repair")

    server.engine.step = step
    return server.publisher.epoch


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
    assert wait_for(lambda: _epochs(client).get(VICTIM, 0) > epoch0, 90, 0.5)
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
