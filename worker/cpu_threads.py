"""CPU threading of a worker process: how many intra-op threads, and how they wait.

torch's CPU kernels (and MKL/oneDNN under them) run on an OpenMP team that, by default,
spin-waits at every barrier before sleeping. When another process takes a core, the spinning
team keeps every core busy, so the one thread that shares its core with the neighbour cannot
move to a free core, and every parallel region waits for it: throughput collapses (a held-out
run measured 102-446 tok/s against 568 quiet). With PASSIVE waiting a thread that finished
its share sleeps at once, its core goes idle, and the kernel's idle balancing moves the
delayed thread there; the cost of a busy neighbour falls to about its share of the machine.
Served (a router and clients on the same 2 cores, light model, 256 streams), a short spin
before sleeping loses too: ``GOMP_SPINCOUNT`` 20k / 200k took the worker's CPU per token from
0.27-0.31 ms to 0.48-0.78 ms (the spinning thread holds the core the router needs), and
``OMP_PROC_BIND=true`` binds the process to one core (one thread does all the work). So no
spin and no binding; an operator's own values still win.

OpenMP reads ``OMP_WAIT_POLICY`` once, when its runtime loads (at ``import torch``), so it
must be in the environment before that: importing the ``worker`` package applies
:func:`apply_wait_policy` (a worker actor's process imports ``worker`` before torch), and
:data:`effective_wait_policy` records whether it was in time. An operator's own setting wins.
The native attention kernel's pool (``attention/native.py``) sleeps on a queue, so it needs
no policy; it splits work finer than one piece per thread so a delayed thread holds up less.

How many threads, per thread: ``worker/model/thread_count.py``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)

# GNU OpenMP (torch's CPU wheels) reads OMP_WAIT_POLICY; Intel OpenMP builds read
# KMP_BLOCKTIME (ms spent spinning before sleeping).
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}

# What OpenMP read when torch loaded: "PASSIVE", the operator's own value, or None when torch
# was loaded before apply_wait_policy ran without one set (OpenMP then keeps spinning).
effective_wait_policy: str | None = None


def worker_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set in a worker process's environment (those ``base`` already sets
    are left to it: an operator's explicit choice wins)."""
    base = os.environ if base is None else base
    return {k: v for k, v in WORKER_ENV.items() if k not in base}


def apply_wait_policy() -> str | None:
    """Set what :data:`WORKER_ENV` names and this process lacks, if torch has not loaded."""
    global effective_wait_policy
    if "torch" not in sys.modules:
        os.environ.update(worker_env())
    elif "OMP_WAIT_POLICY" not in os.environ:
        log.warning(
            "torch was imported before the worker package: OpenMP threads keep spin-waiting "
            "and a busy neighbour core slows the engine (set OMP_WAIT_POLICY=PASSIVE)"
        )
        return None
    effective_wait_policy = os.environ["OMP_WAIT_POLICY"].upper()
    return effective_wait_policy
