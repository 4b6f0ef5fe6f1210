"""Preemption policy: which running request gives its KV blocks up when another cannot grow,
and whether its KV is swapped to the host tier or dropped for recompute.

Pure decisions over the scheduler's state; the scheduler carries them out (``_make_room``,
``_preempt``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any, Literal

from worker.engine.request import Request


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
