"""A router's output channels: one :class:`~router.serving.worker_channel.WorkerChannel` per
worker, opened on the first request for it and reopened after it ended."""

from __future__ import annotations

from typing import Any

from router.serving.worker_channel import WorkerChannel


class Channels:
    """One channel per worker, reopened after it ended (the worker died or restarted)."""

    def __init__(self, incarnation: str, caller: Any = None) -> None:
        self.incarnation = incarnation
        self._caller = caller
        self._by_worker: dict[str, WorkerChannel] = {}

    def get(self, worker_id: str, handle: Any = None) -> WorkerChannel:
        """The open channel to ``worker_id``, (re)opened through ``handle`` if there is none."""
        ch = self._by_worker.get(worker_id)
        if ch is None or not ch.open_for_requests:
            assert handle is not None, f"no open channel to {worker_id}"
            ch = WorkerChannel(worker_id, handle, self.incarnation, self._caller)
            self._by_worker[worker_id] = ch
        return ch

    def close(self) -> None:
        for ch in self._by_worker.values():
            ch.stop()
        self._by_worker.clear()
