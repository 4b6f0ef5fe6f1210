"""Which thread gets a core first when a router's or a worker's process shares its cores with
compute: the event loops ask for a short time slice; a CPU engine's compute threads may run
a few points nicer.

A loop wakes hundreds of times a second to run a short callback (a stream's output, a probe,
a request) and sleeps again; beside it an engine thread and its OpenMP team, the native
attention pool and a client hold every core. Under Linux's fair scheduler (EEVDF) a thread
that wakes gets a core when its virtual deadline comes first, and with the default slice
(0.7-3 ms, scaled by the core count; 1.4 ms on 2 cores) it often waits for the compute
threads' slices to run out: most of a router loop's largest stalls is time runnable without
a core (``benchmarks/serving_path.py --trace-stalls``). Two levers
(``benchmarks/loop_latency.py`` measures both):

* the loop thread asks for a short slice (``sched_setattr``, Linux 6.12+, unprivileged): its
  deadline after a wake-up is near, so it preempts a compute thread at once; it runs its
  callback and sleeps again, so it takes no more CPU than before. Threads it starts later
  inherit the slice;
* ``compute_nice`` (off by default): the engine thread of a worker whose model runs on CPU
  raises its niceness before its OpenMP team and attention pool exist (both inherit it), so
  loops, routers and clients get a core sooner, and the engine yields to every other
  process there too. On a GPU the engine thread feeds the device and is itself
  latency-critical: never demoted.

Both are per thread, need no privilege, and a niceness once raised cannot be lowered again
without one, so they are applied once at start. Where the system lacks one (not Linux, a
kernel before 6.12, a refusal) it is skipped and said once in the log.
"""

from __future__ import annotations

import logging
import threading

from pydantic import Field

from kvstore.runtime import threadsched
from kvstore.runtime.strict import Strict

log = logging.getLogger(__name__)


class ThreadSchedConfig(Strict):
    enabled: bool = Field(
        False,
        description="Apply loop_slice_ms and compute_nice (false: every thread keeps what "
        "the kernel gives it). Off by default: on a shared 2-core machine neither lever "
        "lowered the served loops' stalls measurably (benchmarks/serving_path.py "
        "--thread-sched), while the short slice alone halved a bare loop's (loop_latency).",
    )
    loop_slice_ms: float = Field(
        0.1,
        ge=0.1,
        le=100.0,
        description="Time slice the routers' and workers' event-loop threads ask for (Linux "
        "6.12+; the kernel's own is 0.7-3 ms): a short one lets a loop that wakes preempt a "
        "compute thread at once. Skipped on older kernels and other systems.",
    )
    compute_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="Points of niceness added to a CPU worker's engine thread, its OpenMP "
        "team and attention pool (0: none), so that event loops, routers and clients on "
        "the same cores get a core first; the engine then also yields to every other "
        "process there (served runs measured no gain at 5). Never applied on a GPU.",
    )


_said: set[str] = set()  # what was logged as unsupported, once per process


def _skip(what: str, exc: OSError) -> None:
    if what not in _said:
        _said.add(what)
        log.info("%s not applied: %s", what, exc)


def apply_loop_policy(cfg: ThreadSchedConfig) -> dict:
    """On the event loop's thread at start: its short slice; returns :func:`thread_sched`."""
    if cfg.enabled:
        try:
            threadsched.set_slice(cfg.loop_slice_ms / 1e3)
        except OSError as exc:
            _skip("event-loop time slice", exc)
    return thread_sched()


def demote_compute(cfg: ThreadSchedConfig, device: str) -> int | None:
    """On a CPU engine's thread, before its OpenMP team and kernel pools exist (they inherit
    it): ``compute_nice`` points more niceness. Returns the niceness in effect, None when
    left alone (off, a GPU engine, nothing to add, unsupported)."""
    if not cfg.enabled or not cfg.compute_nice or device.split(":")[0] != "cpu":
        return None
    try:
        return threadsched.set_nice(threadsched.nice() + cfg.compute_nice)
    except OSError as exc:
        _skip("compute threads' niceness", exc)
        return None


def thread_sched(tid: int = 0) -> dict:
    """What the kernel runs thread ``tid`` (0: the caller) with: its slice (ms) and its
    niceness, each None where the system does not say (or the thread is gone); reported
    beside the loop's class."""
    tid = tid or threading.get_native_id()
    out: dict = {"slice_ms": None, "nice": None}
    try:
        out["nice"] = threadsched.nice(tid)
        out["slice_ms"] = threadsched.slice_ns(tid) / 1e6 or None
    except OSError:
        pass
    return out


def custom_slices() -> bool:
    """Whether this system honours a thread's own slice (asked in a thread of its own, which
    ends with it)."""
    works: list[bool] = []

    def probe() -> None:
        try:
            works.append(threadsched.set_slice(threadsched.SLICE_MIN_NS / 1e9) > 0)
        except OSError:
            works.append(False)

    t = threading.Thread(target=probe, name="slice-probe")
    t.start()
    t.join()
    return bool(works and works[0])
