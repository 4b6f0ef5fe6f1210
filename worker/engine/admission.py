"""Cache-aware admission order (``EngineConfig.cache_aware_admission``).

In strict policy order, a waiting request whose prefix is not cached is admitted ahead of one
whose prefix is: its prefill allocates fresh blocks, and when the cache is full they come out
of the prefixes the requests behind it were placed here for, which then recompute them too.
With several requests of different prefixes queued on one worker whose cache holds fewer
prefixes than that, most of a worker's hits are lost this way. So among the leading waiting
requests of the head's policy class (the policy key without its arrival tie-breaker: one
priority level for ``priority``, every request for ``fcfs``), those with the longest prefix
cached on the device now go first, in policy order among equals (the longest-prefix-match
order of SGLang's scheduler); priorities still win, and a request keeps its place in the
order whenever the others cannot tell it apart.

Starvation bound: a request passed by ``max_overtakes`` admissions of requests behind it, or
waiting ``max_wait_s`` seconds, is a barrier: no request behind it is admitted before it any
more (it runs as soon as it fits, as in strict order). The order itself never plans more
passes than a request has left, and a request deferred for a step (its prefix is being
written) is passed only within its bound too.

Cost per step: the first :data:`LOOKAHEAD` waiting requests at most, each an O(log prompt
blocks) bisect over its claimed keys (the device cache is prefix-closed, so its cached keys
of one chain are a leading run); nothing in proportion to the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.engine.policy import SchedulingPolicy
from worker.engine.request import Request
from worker.kv import KVCacheManager

LOOKAHEAD = 32  # waiting requests the order may reorder (the rest keep policy order)


class CacheAwareOrder:
    """Orders the waiting queue for one admission pass, and counts who was overtaken."""

    def __init__(
        self,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        max_overtakes: int,
        max_wait_s: float,
    ) -> None:
        self._kv = kv
        self._policy = policy
        self.max_overtakes = max_overtakes
        self.max_wait_s = max_wait_s

    def order(self, waiting: Sequence[Request], now: float) -> list[Request]:
        """The admission order of ``waiting`` (in policy order): its head (the requests
        before the first barrier, among the leading ones of the head's class) longest cached
        prefix first, ties in policy order, then the rest in policy order. A request goes
        before one ahead of it only while that one can still be passed: even if the whole
        pass is admitted in this order, none is passed more than ``max_overtakes`` times.
        O(head²), the head at most ``LOOKAHEAD``."""
        n = self._movable(waiting, now)
        if n < 2:
            return list(waiting)
        cached = [self._cached_blocks(r) for r in waiting[:n]]
        room = [self.max_overtakes - r.overtaken for r in waiting[:n]]  # >= 1 each
        left = list(range(n))  # policy positions not placed yet
        out: list[Request] = []
        while left:
            best, passable = left[0], True
            for i in left:  # may i go next? only if every one left ahead of it can be passed
                if passable and cached[i] > cached[best]:
                    best = i
                passable = passable and room[i] > 0
            for i in left:
                if i == best:
                    break
                room[i] -= 1
            left.remove(best)
            out.append(waiting[best])
        return out + list(waiting[n:])

    def may_pass(
        self,
        req: Request,
        deferred: Sequence[Request],
        admitted: Sequence[Request],
        now: float,
    ) -> bool:
        """Whether admitting ``req`` keeps the bound of every request ahead of it deferred
        in this pass (its prefix is being written: it waits one step, as in strict order,
        and the requests admitted behind it meanwhile pass it). O(deferred x admitted)."""
        key = self._policy.key
        mine = key(req)
        for d in deferred:
            theirs = key(d)
            if theirs < mine:
                passes = d.overtaken + sum(1 for a in admitted if key(a) > theirs)
                if self._at_bound(d, passes, now):
                    return False
        return True

    def note_admitted(self, waiting: Sequence[Request], admitted: set[str]) -> None:
        """After the pass over ``waiting`` (policy order): each request still waiting counts
        one overtake per admitted request behind it (only the first ``LOOKAHEAD`` can have
        been passed)."""
        behind = 0
        for req in reversed(waiting[:LOOKAHEAD]):
            if req.request_id in admitted:
                behind += 1
            elif behind:
                req.overtaken += behind

    def _movable(self, waiting: Sequence[Request], now: float) -> int:
        if len(waiting) < 2:
            return 0
        key = self._policy.class_key
        cls = key(waiting[0])
        n = 0
        for req in waiting[:LOOKAHEAD]:
            if key(req) != cls:
                break
            if self._at_bound(req, req.overtaken, now):
                break  # a barrier: nothing behind it goes first
            n += 1
        return n

    def _at_bound(self, req: Request, passes: int, now: float) -> bool:
        """Whether ``req``, passed ``passes`` times, may be passed no more."""
        return passes >= self.max_overtakes or now - req.arrival_time >= self.max_wait_s

    def _cached_blocks(self, req: Request) -> int:
        if req.prompt_logprobs is not None or not req.seqs:
            return 0  # every prompt position is computed: no hit to keep
        return self._kv.cached_run(req.seqs[0].claim)
