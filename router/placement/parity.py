"""Parity self-check: the keys the router computed must be the keys the worker stored.

If the router hashes with a different block size, model id, LoRA id, tenant salt or
tokenizer than the engine, every lookup silently misses and the router degrades into a
load balancer with extra latency — the most common failure of prefix-aware routing. The
serving path calls :func:`check_parity` once the chosen worker reports the keys of the
request's blocks; a mismatch is counted and logged at ERROR.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.blocks.hashing import BlockKey
from router.placement.metrics import RouterMetrics

log = logging.getLogger(__name__)


def first_mismatch(router_keys: Sequence[BlockKey], worker_keys: Sequence[BlockKey]) -> int | None:
    """Index of the first differing key over the common length, or ``None`` if they agree.

    Lengths may differ legitimately (the worker may also hold decode blocks, or skip a
    block another sequence already cached), but exactly one side being empty is a mismatch
    at index 0: one of them hashed nothing.
    """
    if bool(router_keys) != bool(worker_keys):
        return 0
    for i, (a, b) in enumerate(zip(router_keys, worker_keys, strict=False)):
        if a != b:
            return i
    return None


def check_parity(
    request_id: str,
    router_keys: Sequence[BlockKey],
    worker_keys: Sequence[BlockKey],
    metrics: RouterMetrics,
) -> bool:
    """Compare, count, and log loudly on a mismatch; returns ``True`` when they agree."""
    metrics.parity_checks += 1
    index = first_mismatch(router_keys, worker_keys)
    if index is None:
        return True
    metrics.parity_mismatches += 1
    n = metrics.parity_mismatches
    if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th, ... mismatch: loud but bounded
        log.error(
            "prefix parity mismatch #%d (request %s): router and worker block keys differ at "
            "block %d (router has %d keys, worker %d). Prefix routing is silently missing: "
            "check that router and workers use the same block size, model id, LoRA id, "
            "tenant cache_salt and tokenizer.",
            n,
            request_id,
            index,
            len(router_keys),
            len(worker_keys),
        )
    return False
