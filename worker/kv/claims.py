"""Claims of queued sequences on the full blocks of their prompts.

A sequence queued behind another that claims the same block will find it cached when its
turn comes (the one ahead computes it), so a load report counts only the rest of its prompt.
The KV manager keeps the one count (:attr:`KVCacheManager.claims`, changed through
:meth:`KVCacheManager.claim` / :meth:`KVCacheManager.unclaim`): its pool evicts a claimed
block only when no unclaimed one is left, so the prefix a request was queued for survives
until it runs. The engine's waiting queue (``worker/engine/waiting.py``) and the trace-replay
simulator claim through it; a caller counting claims of its own (hints) uses a bare one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvstore.blocks.hashing import BlockKey


class BlockClaims(Counter[BlockKey]):
    """Block key -> how many queued sequences claim it."""

    def claim(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """One more claim on each of ``keys``; returns those no sequence claimed before, in
        the given order."""
        first: list[BlockKey] = []
        for key in keys:
            n = self[key]
            if not n:
                first.append(key)
            self[key] = n + 1
        return first

    def release_keys(self, keys: Iterable[BlockKey]) -> tuple[bool, list[BlockKey]]:
        """Drop one claim on each of ``keys``. Returns whether another queued sequence still
        claims one of them (they share a prefix), and the keys no sequence claims any more,
        in the given order."""
        shared = False
        gone: list[BlockKey] = []
        for key in keys:
            left = self[key] - 1
            if left > 0:
                self[key] = left
                shared = True
            elif left == 0:
                del self[key]
                gone.append(key)
            else:
                raise ValueError(f"release of unclaimed block key {key.hex()[:16]}")
        return shared, gone
