"""The engine loop's inbox: commands (``commands.py``) from any thread, run by the engine
thread between steps.

Callers append a command (with the future of its answer, if it has one) and wake the loop;
the engine thread takes what is queued between steps (``drain``). Only the append and the
open/closed flag take the inbox's lock, never a step, so a caller never waits for the engine
to queue a command. A closed inbox refuses new commands with :class:`EngineStopped` saying
why it closed (not started yet, stopped, or the loop died).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future

from kvstore.blocks.errors import EngineStopped
from worker.engine.commands import Command

NOT_STARTED = "the engine loop is not running (call start())"

Entry = tuple[Command, Future | None]  # a command and the future of its answer


class Inbox:
    """A queue of commands with a door: ``submit`` from any thread while it is open."""

    def __init__(self, wake: threading.Event) -> None:
        self._queue: deque[Entry] = deque()
        self._lock = threading.Lock()  # only around appends and the door
        self._closed_because: str | None = NOT_STARTED  # None while open
        self._wake = wake  # set after every append: the loop may be asleep

    def open(self) -> None:
        with self._lock:
            self._closed_because = None

    def close(self, because: str = NOT_STARTED) -> None:
        """Refuse new commands from now on (with ``because``, unless already closed: the
        first reason stands); what is queued stays."""
        with self._lock:
            if self._closed_because is None:
                self._closed_because = because

    def submit(self, command: Command, future: Future | None = None) -> None:
        """Queue ``command``; raises EngineStopped if the inbox is closed."""
        with self._lock:
            if self._closed_because is not None:
                raise EngineStopped(self._closed_because)
            self._queue.append((command, future))
        self._wake.set()

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self) -> Iterator[Entry]:
        """The queued commands in order, each taken off as it is yielded, until none is
        left (those queued meanwhile too)."""
        while self._queue:
            yield self._queue.popleft()
