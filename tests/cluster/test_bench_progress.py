"""``kvcluster bench``'s progress: a bar redrawn in place on a terminal; into a log or pipe, a
line at the start, one per few seconds and one at the end, never one per redraw."""

from __future__ import annotations

import io

from benchmarks.progress import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_bar_redrawn() -> None:
    out = Tty()
    p = Progress(out, 4, "requests")
    for done in range(1, 5):
        p.update(done)
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 4 and text.count("\n") == 1
    assert text.endswith(f"\rrequests [{'#' * 30}] 4/4\n")


def test_a_pipe_gets_a_line_per_few_seconds_and_stage() -> None:
    now = [0.0]
    out = io.StringIO()
    p = Progress(out, 100, "requests", every_s=5.0, clock=lambda: now[0])
    for done in range(1, 101):
        now[0] = done * 0.2  # 20 s in all: a line at 5, 10, 15 s (none at the last update)
        p.update(done)
    p.close()
    assert out.getvalue().splitlines() == [
        "requests started",
        "requests 25/100",
        "requests 50/100",
        "requests 75/100",
        "requests done 100/100",
    ]
    assert "\r" not in out.getvalue()
