"""A bounded queue of write jobs and the one thread that runs them.

The engine must never wait for a disk: :meth:`DiskWriter.submit` either queues a job at once
or refuses it (queue full by count or by bytes, or writer closed), and the caller drops that
store. Jobs run one at a time, in submission order, on the writer's daemon thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Job = TypeVar("Job")


class DiskWriter(Generic[Job]):
    """Runs ``handle(job)`` for each submitted job on one background thread.

    ``handle`` must not raise (an exception is logged and the job counted as done), and is
    the only code that runs on the thread.
    """

    def __init__(
        self,
        handle: Callable[[Job], None],
        *,
        max_jobs: int,
        max_bytes: int,
        name: str = "disk-kv-writer",
    ) -> None:
        if max_jobs < 1 or max_bytes < 1:
            raise ValueError(f"max_jobs and max_bytes must be >= 1, got {max_jobs}, {max_bytes}")
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self._handle = handle
        self._jobs: deque[tuple[Job, int]] = deque()
        self._queued_bytes = 0
        self._running = 0  # jobs taken off the queue and not finished (0 or 1)
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return len(self._jobs)

    def submit(self, job: Job, nbytes: int) -> bool:
        """Queue ``job`` (holding ``nbytes`` of data) unless that would exceed a bound or the
        writer is closed; never blocks."""
        with self._cv:
            if self._closed or len(self._jobs) >= self.max_jobs:
                return False
            if self._jobs and self._queued_bytes + nbytes > self.max_bytes:
                return False  # (a single job larger than the bound still goes alone)
            self._jobs.append((job, nbytes))
            self._queued_bytes += nbytes
            self._cv.notify_all()
            return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs and not self._running, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop the thread (idempotent)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return  # closed and empty
                job, nbytes = self._jobs.popleft()
                self._queued_bytes -= nbytes
                self._running = 1
            try:
                self._handle(job)
            except Exception:  # the thread must survive a bug in one job
                log.exception("disk KV writer: a write job failed")
            finally:
                with self._cv:
                    self._running = 0
                    self._cv.notify_all()
