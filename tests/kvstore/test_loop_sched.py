"""Thread scheduling policy: the calling thread gets it (read back from the kernel), threads it
starts inherit it, the off switch and a GPU engine leave everything alone, and a system
without the call is a no-op said once in the log. Each case runs in a thread of its own: a
niceness once raised cannot be lowered again without privilege."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from kvstore.runtime import loop_sched, threadsched
from kvstore.runtime.loop_sched import (
    ThreadSchedConfig,
    apply_loop_policy,
    custom_slices,
    demote_compute,
    thread_sched,
)

ON = ThreadSchedConfig(enabled=True, compute_nice=5)  # both levers
OFF = ThreadSchedConfig(enabled=False, compute_nice=5)


def in_thread(fn: Callable[[], Any]) -> Any:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(30)
    assert out, "the thread failed"
    return out[0]


def proc_slice_ns(tid: int) -> int:
    """``se.slice`` from /proc: the kernel's own account, not the syscall's."""
    with open(f"/proc/self/task/{tid}/sched") as f:
        line = next(x for x in f if x.startswith("se.slice"))
    return int(float(line.split(":")[1]))


def proc_nice(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


needs_slices = pytest.mark.skipif(
    not custom_slices(), reason=f"no custom fair slices on {os.uname().release} (Linux 6.12+)"
)


@needs_slices
def test_the_loop_thread_gets_its_slice_and_the_others_keep_theirs() -> None:
    main = threadsched.slice_ns()

    def loop() -> tuple[int, dict, int]:
        before = threadsched.nice()
        report = apply_loop_policy(ThreadSchedConfig(enabled=True, loop_slice_ms=0.25))
        return before, report, proc_slice_ns(threading.get_native_id())

    nice_before, report, from_proc = in_thread(loop)
    assert report == {"slice_ms": 0.25, "nice": nice_before}  # its niceness kept
    assert from_proc == 250_000
    assert threadsched.slice_ns() == main  # per thread: this one is untouched


@needs_slices
def test_a_thread_started_by_the_loop_inherits_its_slice() -> None:
    def loop() -> int:
        apply_loop_policy(ON)
        return in_thread(threadsched.slice_ns)

    assert in_thread(loop) == 100_000


def test_a_cpu_engine_thread_and_the_threads_it_starts_are_niced() -> None:
    base = threadsched.nice()

    def engine() -> tuple[int | None, int, int]:
        got = demote_compute(ThreadSchedConfig(enabled=True, compute_nice=3), "cpu")
        # a thread it starts later (its OpenMP team's, its attention pool's)
        child = in_thread(lambda: proc_nice(threading.get_native_id()))
        return got, proc_nice(threading.get_native_id()), child

    got, own, child = in_thread(engine)
    assert got == own == child == min(base + 3, 19)
    assert threadsched.nice() == base


@pytest.mark.parametrize(
    ("cfg", "device"),
    [(OFF, "cpu"), (ThreadSchedConfig(enabled=True), "cpu"), (ON, "cuda"), (ON, "cuda:1")],
)
def test_gpu_engines_and_the_off_switch_leave_the_engine_thread_alone(cfg, device) -> None:
    base = threadsched.nice()
    assert in_thread(lambda: (demote_compute(cfg, device), threadsched.nice())) == (None, base)


def test_the_off_switch_leaves_the_loop_threads_slice() -> None:
    main = thread_sched()
    assert in_thread(lambda: apply_loop_policy(OFF)) == main


def test_without_the_call_it_is_a_no_op_said_once(monkeypatch, caplog) -> None:
    # a syscall number this kernel lacks: the kernel's own ENOSYS
    monkeypatch.setattr(threadsched, "_SYSCALLS", {os.uname().machine: (999_999, 999_998)})
    monkeypatch.setattr(loop_sched, "_said", set())
    caplog.set_level(logging.INFO, logger=loop_sched.__name__)

    def loop() -> tuple[dict, dict]:
        return apply_loop_policy(ON), apply_loop_policy(ON)

    first, second = in_thread(loop)
    assert first == second == {"slice_ms": None, "nice": threadsched.nice()}
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "event-loop time slice not applied" in said[0], said
    assert "Function not implemented" in said[0]


def test_another_system_is_a_no_op(monkeypatch) -> None:
    monkeypatch.setattr(threadsched, "_SYSCALLS", {})
    with pytest.raises(threadsched.Unsupported, match="sched_setattr: unknown on"):
        threadsched.set_slice(0.001)
    assert in_thread(lambda: apply_loop_policy(ON))["slice_ms"] is None


def test_a_slice_out_of_the_kernels_range_is_refused_by_the_config() -> None:
    with pytest.raises(ValidationError, match="loop_slice_ms"):
        ThreadSchedConfig(loop_slice_ms=0.05)
    with pytest.raises(ValidationError, match="compute_nice"):
        ThreadSchedConfig(compute_nice=20)
    with pytest.raises(ValidationError, match="extra"):
        ThreadSchedConfig.model_validate({"loop_slice": 1})
