"""How a router reaches workers: an ABC, so the serving core is testable without Ray."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping

from kvstore.index_types import WorkerLoad
from kvstore.requests.outputs import RequestOutput
from kvstore.requests.protocol import Admitted, WorkerRequest, WorkerStatus


class WorkerGone(Exception):
    """The worker died or became unreachable while serving (or before accepting) a request."""


class WorkerDirectory(ABC):
    """Live workers and handles to them.

    Implementations must: return from ``candidates`` only workers believed alive, with their
    latest load; raise :class:`WorkerGone` from ``stream`` when the worker dies (never hang);
    make ``abort`` safe to call for finished or unknown requests.
    """

    @abstractmethod
    async def candidates(self) -> Mapping[str, WorkerLoad]:
        """Live workers -> last known load."""

    @abstractmethod
    def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> AsyncIterator[Admitted | RequestOutput]:
        """Submit ``request``; yields one :class:`Admitted`, then the engine's outputs."""

    @abstractmethod
    async def abort(self, worker_id: str, request_id: str) -> None:
        """Abort a request (frees its KV blocks on the worker)."""

    @abstractmethod
    async def statuses(self) -> list[WorkerStatus]:
        """Every reachable worker's status."""

    async def resync(self, worker_id: str, reason: str) -> bool:
        """Ask the worker to rebuild its index entries from its pool (``reason`` is logged
        there); False when it could not be asked. Optional: the default asks nobody."""
        return False

    def mark_dead(self, worker_id: str) -> None:  # noqa: B027 - optional hook
        """Stop offering ``worker_id`` until it shows a new heartbeat."""
