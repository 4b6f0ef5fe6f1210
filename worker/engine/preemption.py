"""Preemption: which running request gives its KV blocks up when another cannot grow, whether
its KV is swapped to the host tier or dropped for recompute, and carrying it out.

When a running request cannot grow, the scheduler preempts: the victim (largest policy key:
lowest priority, latest arrival) loses all its blocks and goes back to the waiting queue,
where the prefix cache gives back whatever survived when it is resumed. With a host KV tier
the victim's blocks are *swapped* (kept: the device evicts them into the host tier, and its
resumption loads them back) or dropped for *recompute*, whichever the estimate says is
cheaper (``preemption_mode``). A resumed request is *protected* until it produces a token, so
two requests cannot keep preempting each other without progress.

The decisions (:func:`pick_victim`, :func:`should_swap`) are pure functions over the
scheduler's state; :class:`Preemption`, mixed into
:class:`~worker.engine.scheduler.Scheduler`, carries them out.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, Literal

from worker.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.policy import SchedulingPolicy
    from worker.engine.sched_output import SchedulerOutput
    from worker.kv import KVCacheManager


def pick_victim(
    req: Request,
    running: Iterable[Request],
    touched: Collection[str],
    key: Callable[[Request], Any],
) -> Request | None:
    """The request to preempt so that ``req`` can grow (``req`` itself if it must yield), or
    ``None`` if ``req`` must stop for this step.

    ``key`` is the policy's order (largest: lowest priority, latest arrival). Never a request
    in ``touched`` (ids that got blocks in this step: their blocks are registered in the
    prefix cache but not yet written) nor a doomed one. A protected request (resumed, no
    token yet) is spared unless ``req`` is protected too and nobody else is left, so two
    requests cannot keep preempting each other without progress.
    """
    others = [r for r in running if r is not req and r.request_id not in touched and not r.doomed]
    worse = [r for r in others if not r.protected and key(r) > key(req)]
    if worse:
        return max(worse, key=key)
    if req.protected:  # a resumed request progresses before anyone else is spared
        unprotected = [r for r in others if not r.protected]
        if unprotected:
            return max(unprotected, key=key)
    if req.request_id in touched:
        return None  # it already got blocks this step: freeing them now is unsafe
    if req.protected:
        return max([*others, req], key=key)
    return req


def should_swap(
    req: Request,
    *,
    mode: Literal["auto", "swap", "recompute"],
    has_host_tier: bool,
    block_size: int,
    block_cost: float,
) -> bool:
    """Swap ``req``'s KV out (keep it for the host tier) rather than drop it for recompute?

    ``auto``: swap when loading its full blocks back (``block_cost`` prompt tokens of
    prefill each) is estimated cheaper than recomputing its tokens; without a host tier,
    always recompute.
    """
    if not has_host_tier or mode == "recompute":
        return False
    if mode == "swap":
        return True
    tokens = sum(s.num_computed for s in req.seqs if s.allocated)
    return (tokens // block_size) * block_cost < tokens


class Preemption:
    """Preempting and dooming requests (state set up by ``Scheduler.__init__``; needs its
    ``free_seq`` and ``add``)."""

    config: EngineConfig
    kv: KVCacheManager
    policy: SchedulingPolicy
    running: list[Request]
    _touched: set[str]  # requests that got blocks in this step
    _out: SchedulerOutput

    def _make_room(self, req: Request) -> bool:
        """Preempt one request so ``req`` can grow; False if ``req`` must stop for this step."""
        victim = pick_victim(req, self.running, self._touched, self.policy.key)
        if victim is None:
            return False
        if victim is req and len(self.running) == 1:
            self._doom(req)  # alone and still too big: it can never fit
            return False
        self._preempt(victim)
        return victim is not req

    def _preempt(self, req: Request) -> None:
        assert req.request_id not in self._touched, "preempting a request scheduled this step"
        self.running.remove(req)
        cfg = self.config
        swap = should_swap(
            req,
            mode=cfg.preemption_mode,
            has_host_tier=self.kv.has_host_tier,
            block_size=self.kv.block_size,
            block_cost=cfg.host_load_block_cost,
        )
        for seq in req.seqs:
            self.free_seq(seq, offload=swap)
        if swap:
            self._out.swapped.append(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.protected = False
        req.num_preemptions += 1
        self.add(req)
        self._out.preempted.append(req.request_id)

    def _doom(self, req: Request) -> None:
        if not req.doomed:
            req.doomed = True
            self._out.doomed.append(req)
