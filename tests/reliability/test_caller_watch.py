"""CallerWatch without Ray: which callers count as dead, and that their requests (only theirs)
are aborted. Callers are stand-ins answering the two pings the watch sends (``__ray_ready__``
of a plain handle, ``incarnation`` of a router's :class:`CallerRef`). Every wait polls for its
condition with a generous deadline; nothing depends on how fast the watch's rounds run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ray.exceptions import ActorDiedError

from kvstore.requests.protocol import CallerRef
from worker.callers import CallerWatch

DEADLINE_S = 30.0


class _Method:
    def __init__(self, fn: Callable[[], Awaitable[Any]]) -> None:
        self._fn = fn

    def remote(self) -> Awaitable[Any]:
        return self._fn()


class FakeRouter:
    """A caller in one of the states the watch must tell apart; counts the pings it got."""

    def __init__(self, state: str, incarnation: str = "i1") -> None:
        self.state = state  # "alive", "dead" or "slow" (never answers)
        self.now = incarnation  # what ``incarnation`` answers
        self.pings = 0
        self.__ray_ready__ = _Method(self._answer)
        self.incarnation = _Method(self._incarnation)

    async def _answer(self) -> bool:
        self.pings += 1
        if self.state == "dead":
            raise ActorDiedError()
        if self.state == "slow":
            await asyncio.sleep(3600)
        return True

    async def _incarnation(self) -> str:
        await self._answer()
        return self.now


async def _until(predicate: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_only_the_requests_of_dead_or_restarted_callers_are_aborted() -> None:
    async def scenario() -> None:
        aborted: list[str] = []
        watch = CallerWatch(aborted.append, interval_s=0.01, ping_timeout_s=0.05)
        alive, dead, slow = FakeRouter("alive"), FakeRouter("dead"), FakeRouter("slow")
        restarted = FakeRouter("alive", incarnation="i2")  # Ray restarted it: new incarnation
        same = FakeRouter("alive")
        watch.watch("a1", alive)
        watch.watch("d1", dead)
        watch.watch("d2", dead)
        watch.watch("s1", slow)
        watch.watch("r1", CallerRef(restarted, "i1"))
        watch.watch("c1", CallerRef(same, "i1"))
        watch.watch("none", None)  # no caller: never watched
        await _until(lambda: len(aborted) == 3)
        assert sorted(aborted) == ["d1", "d2", "r1"] and watch.aborted == 3
        assert dead.pings == 1  # one ping per distinct caller and round
        # several more rounds, in which the living and the slow are pinged but kept
        marks = alive.pings, slow.pings, same.pings
        await _until(lambda: alive.pings >= marks[0] + 3 and same.pings >= marks[2] + 3)
        await _until(lambda: slow.pings >= marks[1] + 2)  # timed out twice: not proven dead
        assert sorted(aborted) == ["d1", "d2", "r1"]
        # a request that ended is forgotten: its caller dying later aborts nothing
        watch.forget("a1")
        alive.state = "dead"
        slow.state = "dead"
        await _until(lambda: "s1" in aborted)
        assert sorted(aborted) == ["d1", "d2", "r1", "s1"]
        watch.forget("c1")
        await _until(lambda: watch._task is not None and watch._task.done())  # nothing to watch

    asyncio.run(scenario())


def test_a_dead_callers_idle_channel_is_reported_and_forgotten() -> None:
    """A channel with no open request still keeps its caller watched: once the caller dies
    the watch reports it (the worker drops its channels) and stops watching."""

    async def scenario() -> None:
        dead_callers: list[Any] = []
        aborted: list[str] = []
        watch = CallerWatch(
            aborted.append, interval_s=0.01, ping_timeout_s=0.05, on_dead=dead_callers.append
        )
        router, other = FakeRouter("alive"), FakeRouter("alive")
        watch.watch_channel("ch-a", CallerRef(router, "i1"))
        watch.watch_channel("ch-b", CallerRef(other, "i1"))
        await _until(lambda: router.pings >= 3)  # watched with no request at all
        assert dead_callers == [] and aborted == []
        router.state = "dead"
        await _until(lambda: dead_callers == [CallerRef(router, "i1")])
        assert aborted == [] and watch._channels == {"ch-b": CallerRef(other, "i1")}
        watch.forget_channel("ch-b")
        await _until(lambda: watch._task is not None and watch._task.done())

    asyncio.run(scenario())
