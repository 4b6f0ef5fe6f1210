"""Per-thread CPU scheduling on Linux: the time slice a thread asks for, its niceness, its
policy. The kernel's calls, through ``ctypes`` where Python has none (``sched_setattr``).

Linux's fair scheduler (EEVDF, 6.6 on) runs the runnable thread with the earliest virtual
deadline, its eligible time plus its slice scaled by its weight. Since 6.12 a fair thread may
ask for its own slice (``sched_attr.sched_runtime``, 0.1-100 ms, no privilege needed): a
short one gives a woken thread an early deadline, so it preempts a thread that has run its
slice out at once instead of waiting for it to end. Niceness is per thread too
(``setpriority`` on a thread id), and a thread created later starts from its creator's.
A kernel before 6.12 takes the slice without a word and ignores it: :func:`set_slice` reads it
back and says whether it holds. This module only reads and sets; the policy a process
applies is ``kvstore/runtime/loop_sched.py``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading

SCHED_OTHER = 0
SCHED_BATCH = 3
SCHED_IDLE = 5
FAIR_POLICIES = (SCHED_OTHER, SCHED_BATCH, SCHED_IDLE)
SLICE_MIN_NS = 100_000  # the kernel clamps a fair thread's slice into [0.1 ms, 100 ms]
SLICE_MAX_NS = 100_000_000

# sched_setattr / sched_getattr: Python's os module has neither
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}


class SchedAttr(ctypes.Structure):
    """``struct sched_attr``, the first version (48 bytes: no utilization clamps)."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),  # a fair thread's requested slice, ns (6.12+)
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
    ]


class Unsupported(OSError):
    """This system cannot do it (not Linux, an unknown architecture, a kernel without custom
    slices, or a policy the thread is not allowed); the message says which."""


def _libc() -> ctypes.CDLL:
    if not hasattr(_libc, "lib"):
        _libc.lib = ctypes.CDLL(None, use_errno=True)  # type: ignore[attr-defined]
    return _libc.lib  # type: ignore[attr-defined]


def _syscalls() -> tuple[int, int]:
    if not os.uname().sysname == "Linux":
        raise Unsupported(errno.ENOSYS, f"thread scheduling attributes: not Linux ({os.name})")
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        raise Unsupported(errno.ENOSYS, f"sched_setattr: unknown on {platform.machine()}")
    return numbers


def get_attr(tid: int = 0) -> SchedAttr:
    """Thread ``tid``'s scheduling attributes (0: the calling thread)."""
    _, getattr_nr = _syscalls()
    attr = SchedAttr()
    if _libc().syscall(getattr_nr, tid, ctypes.byref(attr), ctypes.sizeof(SchedAttr), 0) != 0:
        err = ctypes.get_errno()
        raise Unsupported(err, f"sched_getattr: {os.strerror(err)}")
    return attr


def _set_attr(attr: SchedAttr, tid: int) -> None:
    setattr_nr, _ = _syscalls()
    attr.size = ctypes.sizeof(SchedAttr)
    if _libc().syscall(setattr_nr, tid, ctypes.byref(attr), 0) != 0:
        err = ctypes.get_errno()
        raise Unsupported(err, f"sched_setattr: {os.strerror(err)}")


def slice_ns(tid: int = 0) -> int:
    """The slice thread ``tid`` runs with, ns (0 on a kernel that does not report one)."""
    return int(get_attr(tid).sched_runtime)


def set_slice(slice_s: float, tid: int = 0) -> int:
    """Ask for a ``slice_s`` slice for thread ``tid`` (0: the caller), its policy and niceness
    kept; returns the slice in effect, ns. :class:`Unsupported` where the kernel ignores it."""
    want = min(max(int(slice_s * 1e9), SLICE_MIN_NS), SLICE_MAX_NS)
    attr = get_attr(tid)
    if attr.sched_policy not in FAIR_POLICIES:
        raise Unsupported(errno.EINVAL, f"slice: thread runs policy {attr.sched_policy}")
    attr.sched_runtime = want
    attr.sched_flags = 0  # sched_nice is set as read: the thread keeps its niceness
    attr.sched_deadline = attr.sched_period = 0
    _set_attr(attr, tid)
    got = slice_ns(tid)
    if got != want:  # before 6.12 a fair thread's runtime is accepted and dropped
        raise Unsupported(errno.ENOSYS, f"slice: kernel {os.uname().release} keeps its own")
    return got


def set_policy(policy: int, tid: int = 0) -> None:
    """Move thread ``tid`` to fair ``policy`` (SCHED_OTHER / SCHED_BATCH / SCHED_IDLE), its
    niceness and slice kept."""
    assert policy in FAIR_POLICIES, policy
    attr = get_attr(tid)
    attr.sched_policy = policy
    attr.sched_flags = 0
    attr.sched_priority = 0
    _set_attr(attr, tid)


def nice(tid: int = 0) -> int:
    """Thread ``tid``'s niceness (0: the caller)."""
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())


def set_nice(value: int, tid: int = 0) -> int:
    """Set thread ``tid``'s niceness (raising it needs no privilege); returns it."""
    tid = tid or threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(max(value, -20), 19))
    return nice(tid)
