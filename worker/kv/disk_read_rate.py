"""The measured read speed of a disk KV tier: what a disk hit costs in seconds.

A hit on disk pays only when reading its blocks beats recomputing their tokens (a slow or
busy disk can read slower than a GPU prefills). The rate starts from a timed read when the
store opens and follows real reads as an exponentially weighted moving average, so a disk
that slows down under load is priced as it is now, not as it was at start-up.
"""

from __future__ import annotations

import threading

MIN_SECONDS = 1e-6  # a read timed at 0 s (coarse clock) counts as this long


class ReadRate:
    """Bytes per second of reads from one directory (EWMA); safe to use from any thread."""

    def __init__(self, bytes_per_s: float, *, alpha: float = 0.2, latency_s: float = 0.0) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha  # weight of the newest read
        self.latency_s = latency_s  # fixed cost of one read (open + first seek), added once
        self._bytes_per_s = float(bytes_per_s)
        self._lock = threading.Lock()  # reads are timed on callers' threads, priced on another

    @property
    def bytes_per_s(self) -> float:
        return self._bytes_per_s

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold one timed read of ``nbytes`` into the average."""
        if nbytes <= 0:
            return
        sample = nbytes / max(seconds, MIN_SECONDS)
        with self._lock:
            self._bytes_per_s += self.alpha * (sample - self._bytes_per_s)

    def seconds_for(self, nbytes: int) -> float:
        """Estimated seconds to read ``nbytes`` (0 for nothing to read)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self._bytes_per_s
