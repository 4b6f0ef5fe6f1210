"""One thread that runs each armed action at its time unless it was disarmed first: the
client's hold on its streamed calls' deadlines, without a timer thread per call."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable


class DeadlineWatch:
    """``arm(at, action)`` runs ``action`` at monotonic time ``at`` on the watch's thread,
    unless ``disarm`` got its token first. Actions must be quick and must not raise (a
    grpc call's ``cancel``). The thread starts at the first ``arm`` and ends with ``close``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []  # (at, token), earliest first
        self._armed: dict[int, Callable[[], object]] = {}  # token -> action, until run
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, at: float, action: Callable[[], object]) -> int:
        with self._cond:
            token = next(self._tokens)
            self._armed[token] = action
            heapq.heappush(self._heap, (at, token))
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="kvc-deadline-watch", daemon=True
                )
                self._thread.start()
            self._cond.notify()
            return token

    def disarm(self, token: int) -> None:
        with self._cond:
            self._armed.pop(token, None)  # its heap entry is skipped when it comes due

    def armed(self) -> int:
        with self._cond:
            return len(self._armed)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._armed.clear()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    while self._heap and self._heap[0][1] not in self._armed:
                        heapq.heappop(self._heap)
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._closed:
                    return
                _, token = heapq.heappop(self._heap)
                action = self._armed.pop(token)
            action()
