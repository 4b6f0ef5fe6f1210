"""Parity self-check: the keys the router computed must be the keys the worker stored.

If the router hashes with a different block size, model id, LoRA id, tenant salt or
tokenizer than the engine, every lookup silently misses and the router degrades into a
load balancer with extra latency — the most common failure of prefix-aware routing. The
serving path calls :func:`check_parity` once the chosen worker reports the key of the
prompt's last full block; a mismatch is counted and logged at ERROR.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.blocks.hashing import BlockKey
from router.placement.router_metrics import RouterMetrics

log = logging.getLogger(__name__)


def check_parity(
    request_id: str,
    router_keys: Sequence[BlockKey],
    worker_key: BlockKey | None,
    metrics: RouterMetrics,
) -> bool:
    """Compare the router's last key with the worker's (keys are chained: the last one names
    the whole prefix), count, and log loudly on a mismatch; ``True`` when they agree."""
    metrics.parity_checks += 1
    if (router_keys[-1] if router_keys else None) == worker_key:
        return True
    metrics.parity_mismatches += 1
    n = metrics.parity_mismatches
    if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th, ... mismatch: loud but bounded
        log.error(
            "prefix parity mismatch #%d (request %s): router and worker keys of the prompt's "
            "last full block (block %d) differ%s. Prefix routing is silently missing: check "
            "that router and workers use the same block size, model id, LoRA id, tenant "
            "cache_salt and tokenizer.",
            n,
            request_id,
            len(router_keys) - 1,
            " (the worker hashed no block)" if worker_key is None else "",
        )
    return False
