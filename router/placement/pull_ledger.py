"""The router's own pulls in flight, and what its pulls realised: what the pull planner's
back-off reads (``router/placement/pull.py``).

- **In flight.** A pull the router advised is *exporting* until the worker reports it
  (``Admitted.pulled``: its source has copied the run out, it is imported or given up), and
  *landing* until its request has its first token (or ends): until then the pulled blocks
  sit in the destination's cache unpinned, next to the blocks of the requests queued ahead
  of it. The planner caps the exports in flight per source (each export waits for a window
  of the holder's engine, one after another) and counts the landing blocks against the
  destination's free KV (no heartbeat shows them yet).
- **Survival.** Per destination, the share of a pull's imported tokens its request found
  cached when it ran (1: all of them; an import that the requests queued ahead evicted
  before its own ran, or a pull that failed, gives less): a moving average, the weight of
  each sample ``alpha``. Its shortfall decays back toward 1 with a half-life of
  ``recovery_s`` seconds, so a destination that stopped being pulled to (it missed) is tried
  again once its queue has had time to change, not never.

Plain Python, owned by the router's decide thread like the planner.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True)
class _Pull:
    source: str
    dest: str
    blocks: int
    exporting: bool = True


class PullLedger:
    def __init__(self, *, alpha: float, recovery_s: float) -> None:
        assert 0 < alpha <= 1 and recovery_s > 0
        self.alpha = alpha
        self.recovery_s = recovery_s
        self._open: dict[int, _Pull] = {}
        self._next = 0
        self.exporting: Counter[str] = Counter()  # source -> its exports in flight
        self.landing_blocks: Counter[str] = Counter()  # destination -> blocks not yet used
        self._survival: dict[str, tuple[float, float]] = {}  # dest -> (share, at)

    def begin(self, source: str, dest: str, blocks: int) -> int:
        """A pull was advised; its ticket (:meth:`landed` and :meth:`end` take it)."""
        self._next += 1
        self._open[self._next] = _Pull(source, dest, blocks)
        self.exporting[source] += 1
        self.landing_blocks[dest] += blocks
        return self._next

    def landed(self, ticket: int) -> None:
        """The worker reported the pull (done, or given up): its source is free."""
        pull = self._open.get(ticket)
        if pull is not None and pull.exporting:
            pull.exporting = False
            self._drop(self.exporting, pull.source, 1)

    def end(self, ticket: int) -> None:
        """Its request runs (first token: its blocks are pinned) or ended. Idempotent."""
        self.landed(ticket)
        pull = self._open.pop(ticket, None)
        if pull is not None:
            self._drop(self.landing_blocks, pull.dest, pull.blocks)

    def in_flight(self) -> int:
        return len(self._open)

    def survival(self, dest: str, now: float) -> float:
        """The expected share of a pull's tokens its request finds cached (1 when unknown)."""
        got = self._survival.get(dest)
        if got is None:
            return 1.0
        share, at = got
        return 1.0 - (1.0 - share) * 0.5 ** (max(now - at, 0.0) / self.recovery_s)

    def observe(self, dest: str, share: float, now: float) -> None:
        """A pull to ``dest`` realised ``share`` (0..1) of its imported tokens as a hit."""
        s = self.survival(dest, now)
        share = min(max(share, 0.0), 1.0)
        self._survival[dest] = (s + self.alpha * (share - s), now)

    @staticmethod
    def _drop(counts: Counter[str], key: str, n: int) -> None:
        counts[key] -= n
        if counts[key] <= 0:
            del counts[key]
