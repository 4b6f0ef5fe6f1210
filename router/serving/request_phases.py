"""Where a router's requests are waiting, counted by phase (``kvc_router_requests{phase}`` on
``/metrics``): ``routing`` (hashing, the index read and the policy), ``submitting`` (sent, the
worker's admission answer not back yet), ``first_token`` (admitted: in the worker's waiting
queue or its prefill, until the first token), ``streaming`` (tokens flowing). A retry moves a
request back to ``routing``."""

from __future__ import annotations

PHASES = ("routing", "submitting", "first_token", "streaming")


class RequestPhases:
    """Requests per phase (on the router's event loop: plain ints)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(PHASES, 0)

    def move(self, old: str | None, new: str | None) -> str | None:
        """A request leaves ``old`` for ``new`` (None: it was not counted / it ended);
        returns ``new``."""
        if old is not None:
            self.counts[old] -= 1
            assert self.counts[old] >= 0, old
        if new is not None:
            self.counts[new] += 1
        return new
