"""``stop_group``: a process group we started is gone when it returns — SIGTERM first, then
SIGKILL once the grace ends for what ignored it (as a Ray head that served a driver does)."""

from __future__ import annotations

import subprocess
import time

from cluster.state import group_alive, stop_group


def _group(script: str) -> int:
    proc = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while not group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc.pid


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    pgid = _group("trap '' TERM; sleep 60 & wait; sleep 60")
    time.sleep(0.2)  # the trap is set
    t0 = time.monotonic()
    stop_group(pgid, grace_s=0.5)
    took = time.monotonic() - t0
    assert not group_alive(pgid)
    assert 0.5 <= took < 10  # waited out the grace, not the group's 60 s


def test_a_group_that_honours_sigterm_stops_without_waiting_the_grace() -> None:
    pgid = _group("sleep 60")
    t0 = time.monotonic()
    stop_group(pgid, grace_s=30)
    assert not group_alive(pgid) and time.monotonic() - t0 < 10
