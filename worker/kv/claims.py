"""Claims of queued sequences on the full blocks of their prompts.

A sequence queued behind another that claims the same block will find it cached when its
turn comes (the one ahead computes it), so a load report counts only the rest of its prompt.
The engine's waiting queue owns one (``worker/engine/waiting.py``), the trace-replay
simulator another; the KV manager only answers which blocks are cached
(:meth:`KVCacheManager.expected_prefix`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvstore.blocks.hashing import BlockKey


class BlockClaims(Counter[BlockKey]):
    """Block key -> how many queued sequences claim it."""

    def claim(self, keys: Iterable[BlockKey]) -> None:
        self.update(keys)

    def release(self, keys: Iterable[BlockKey]) -> bool:
        """Drop one claim on each of ``keys``; True if another queued sequence still claims
        one of them (they share a prefix)."""
        shared = False
        for key in keys:
            left = self[key] - 1
            if left:
                self[key] = left
                shared = True
            else:
                del self[key]
        return shared
