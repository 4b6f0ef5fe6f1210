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
scheduler's state; :class:`Preemption`, which the scheduler holds, takes them with the
engine's config and carries them out.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, Literal

from worker.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.policy import SchedulingPolicy
    from worker.engine.sched_output import SchedulerOutput
    from worker.engine.waiting import WaitingQueue
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
    """One scheduler's preemption policy: picks the victim, swaps or drops its KV, requeues it.

    The scheduler owns the running list and the step's state and passes them in; this class
    keeps only its collaborators: the KV manager, the waiting queue the victims go back to and
    the scheduler's ``free_seq`` (which gives a sequence's blocks back)."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        waiting: WaitingQueue,
        free_seq: Callable[..., None],
    ) -> None:
        self.mode = config.preemption_mode
        self.block_cost = config.host_load_block_cost  # see EngineConfig.host_load_block_cost
        self.kv = kv
        self.key = policy.key
        self.waiting = waiting
        self.free_seq = free_seq

    def victim(
        self, req: Request, running: Iterable[Request], touched: Collection[str]
    ) -> Request | None:
        """Whom to preempt so ``req`` can grow (see :func:`pick_victim`)."""
        return pick_victim(req, running, touched, self.key)

    def preempt(
        self,
        req: Request,
        running: list[Request],
        touched: Collection[str],
        out: SchedulerOutput,
    ) -> None:
        """Take ``req`` out of ``running``, its KV swapped to the host tier or dropped for
        recompute (:func:`should_swap`), and queue it again; recorded in ``out``."""
        assert req.request_id not in touched, "preempting a request scheduled this step"
        running.remove(req)
        swap = should_swap(
            req,
            mode=self.mode,
            has_host_tier=self.kv.has_host_tier,
            block_size=self.kv.block_size,
            block_cost=self.block_cost,
        )
        for seq in req.seqs:
            self.free_seq(seq, offload=swap)
        if swap:
            out.swapped.append(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.protected = False
        req.num_preemptions += 1
        self.waiting.add(req)
        out.preempted.append(req.request_id)
