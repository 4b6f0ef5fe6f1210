"""The router's calls to a worker actor keep their deadlines even when the worker's handle
is slow to look up (Ray's GCS busy or gone): the lookup counts against the call's timeout."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from router.serving.answer_cache import AnswerCache
from router.serving.ray_workers import STATUS_REUSE_S, RayWorkerDirectory


def _directory_whose_lookups_never_end() -> RayWorkerDirectory:
    d = object.__new__(RayWorkerDirectory)  # only the lookup and the timeouts are used
    d.timeouts = SimpleNamespace(probe_timeout_s=0.05, status_timeout_s=0.05)
    d.call_timeout_s = 0.05

    async def never(worker_id: str) -> object:
        await asyncio.Event().wait()

    d._handle = never
    return d


def test_probe_abort_resync_and_status_time_out_during_a_stuck_lookup() -> None:
    d = _directory_whose_lookups_never_end()

    async def calls() -> tuple:
        return (
            await d._ping("worker-0"),
            await d.abort("worker-0", "req-1"),
            await d.resync("worker-0", "test"),
            await d._status("worker-0"),
        )

    # the outer bound only turns a hang into a failure; each call gives up after 0.05 s
    assert asyncio.run(asyncio.wait_for(calls(), 10)) == (False, None, False, None)


def test_status_calls_at_once_share_one_round_and_reuse_it_briefly() -> None:
    """``GET /metrics`` is open to anyone and each round calls every worker: a flood of them
    costs one round per reuse window, not one per call."""
    d = object.__new__(RayWorkerDirectory)  # only the status round is used
    d._statuses = AnswerCache(STATUS_REUSE_S)
    rounds = []

    async def ask() -> list:
        rounds.append(1)
        await asyncio.sleep(0.05)
        return [f"status-{len(rounds)}"]

    d._ask_statuses = ask

    async def main() -> list:
        burst = await asyncio.gather(*(d.statuses() for _ in range(50)))
        again = await d.statuses()  # within the reuse window
        await asyncio.sleep(STATUS_REUSE_S + 0.05)
        later = await d.statuses()
        return [*burst, again, later]

    answers = asyncio.run(asyncio.wait_for(main(), 10))
    assert answers == [["status-1"]] * 51 + [["status-2"]] and len(rounds) == 2
