"""The engine's measured prefill speed: what recomputing a prompt's tokens costs in seconds.

A lower tier that is slower to read than recomputing (a busy disk) is left to recompute
(``KVCacheManager(recompute_seconds=...)``). The figure comes from the engine's own steps:
each step that ran enough prompt tokens folds its tokens per second of forward time into an
exponentially weighted average; before the first such step recomputing is priced as
unknown (infinite), so a lower-tier hit is loaded.
"""

from __future__ import annotations

import math

MIN_TOKENS = 32  # a step with fewer prompt tokens times decode work, not prefill


class PrefillRate:
    """Prefill tokens per second (EWMA of measured steps); engine thread only."""

    def __init__(self, tokens_per_s: float | None = None, *, alpha: float = 0.2) -> None:
        if tokens_per_s is not None and tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s must be > 0, got {tokens_per_s}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha  # weight of the newest step
        self.tokens_per_s = tokens_per_s  # None: not measured yet

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        """Fold one step that computed ``prefill_tokens`` prompt tokens in ``seconds``."""
        if prefill_tokens < MIN_TOKENS or seconds <= 0:
            return
        sample = prefill_tokens / seconds
        if self.tokens_per_s is None:
            self.tokens_per_s = sample
        else:
            self.tokens_per_s += self.alpha * (sample - self.tokens_per_s)

    def seconds_for(self, num_tokens: int) -> float:
        """Estimated seconds to recompute ``num_tokens`` tokens (inf before a measurement)."""
        if self.tokens_per_s is None:
            return math.inf
        return num_tokens / self.tokens_per_s
