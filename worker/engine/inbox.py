"""The streaming front's inbox: commands from any thread, run by the engine thread.

Callers append a :class:`Command` and wake the loop; the engine thread runs what is queued
between steps (``drain``). Only the append and the open/closed flag take the inbox's lock,
never a step, so a caller never waits for the engine to queue a command. A closed inbox
refuses new commands with :class:`EngineStopped` saying why it closed (not started yet,
stopped, or the loop died).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.blocks.errors import EngineStopped

log = logging.getLogger(__name__)
NOT_STARTED = "the streaming engine is not running (call start())"


@dataclass(frozen=True, slots=True)
class Command:
    """One queued command for the engine thread."""

    run: Callable[[], None]  # between steps, with the engine lock held
    refuse: Callable[[BaseException], None] | None = None  # instead, if the loop died first


class Inbox:
    """A queue of commands with a door: ``submit`` from any thread while it is open."""

    def __init__(self, wake: threading.Event) -> None:
        self._queue: deque[Command] = deque()
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

    def submit(self, command: Command) -> None:
        """Queue ``command``; raises EngineStopped if the inbox is closed."""
        with self._lock:
            if self._closed_because is not None:
                raise EngineStopped(self._closed_because)
            self._queue.append(command)
        self._wake.set()

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self) -> None:
        """Run the queued commands (engine thread, or stop() after the thread ended)."""
        while self._queue:
            self._queue.popleft().run()

    def fail(self, stopped: EngineStopped) -> None:
        """After a death: queued adds are refused with ``stopped``, queued calls still run
        (they read the engine; an abort finds its request gone with the streams)."""
        while self._queue:
            command = self._queue.popleft()
            try:
                if command.refuse is not None:
                    command.refuse(stopped)
                else:
                    command.run()
            except Exception:  # noqa: BLE001 - the engine is beyond repair
                log.exception("a queued command failed after the engine loop died")
