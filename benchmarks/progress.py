"""A progress report that fits where it goes: on a terminal, one bar redrawn in place; into a
log or a pipe (where every redraw would be a new line), a line when a stage starts, one every
few seconds while it runs, and one when it ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 30
LINE_EVERY_S = 5.0  # off a terminal: at most one line per this many seconds mid-stage


class Progress:
    """Progress of one stage of ``total`` steps on ``stream``; call :meth:`update` with the
    steps done so far and :meth:`close` at the end."""

    def __init__(
        self,
        stream: TextIO,
        total: int,
        label: str = "",
        *,
        every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.total = total
        self.label = f"{label} " if label else ""
        self.every_s = every_s
        self._clock = clock
        isatty = getattr(stream, "isatty", None)
        self.terminal = bool(isatty and isatty())
        self.done = 0
        self._last_line = clock()
        if not self.terminal:
            self._line("started")

    def update(self, done: int) -> None:
        self.done = done
        if self.terminal:
            bar = "#" * (BAR_WIDTH * done // max(self.total, 1))
            text = f"\r{self.label}[{bar:<{BAR_WIDTH}}] {done}/{self.total}"
            print(text, end="", file=self.stream, flush=True)
        elif done < self.total and self._clock() - self._last_line >= self.every_s:
            self._line(f"{done}/{self.total}")

    def close(self) -> None:
        if self.terminal:
            print(file=self.stream, flush=True)
        else:
            self._line(f"done {self.done}/{self.total}")

    def _line(self, text: str) -> None:
        self._last_line = self._clock()
        print(f"{self.label}{text}".strip(), file=self.stream, flush=True)
