"""How many intra-op threads the model runs with, and where that is set.

OpenMP keeps the team size per OS thread (``omp_set_num_threads`` sets the calling thread's
value; a thread started later begins from ``OMP_NUM_THREADS``, which Ray sets in an actor
to the whole CPUs it reserves, at least 1). So ``torch.set_num_threads`` in one thread leaves
the engine loop's thread as it was: :func:`configure_threads` must run in the thread that
runs the model, and ``EngineLoop`` applies the engine's count (``Engine.cpu_threads``)
at the start of its loop. How the threads wait: ``worker/cpu_threads.py``.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a cgroup)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def configure_threads(threads: int | None = None, *, fresh_pool: bool = False) -> int:
    """Set torch's intra-op threads *for the calling thread* (default: the cores this
    process may use) and size the native kernels' pool to match; returns the count.
    ``fresh_pool``: a new pool even at the same size, its threads started from this thread
    (they inherit its niceness; a pool used before kept its first user's)."""
    import torch

    from worker.attention import native

    torch.set_num_threads(max(1, threads or available_cores()))
    native.resize_pool(torch.get_num_threads(), fresh=fresh_pool)
    return torch.get_num_threads()


def current_threads() -> int:
    """torch's intra-op threads in the calling thread."""
    import torch

    return torch.get_num_threads()
