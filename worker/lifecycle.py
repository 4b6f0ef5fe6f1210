"""The worker process's own lifecycle: whether it runs as a Ray actor, and leaving for a
restart once its engine died."""

from __future__ import annotations

import os
import threading
import time

import ray


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor's (asked once, from the actor's own thread)."""
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def exit_process_soon(in_actor: bool, grace_s: float = 1.0) -> None:
    """In a Ray actor: exit the process after ``grace_s`` (the streams' errors reach their
    callers first). Ray sees a crash, not an intentional exit, so it restarts the actor.
    Outside an actor (a plain ``WorkerServer`` in a test or a script) it does nothing."""
    if not in_actor:
        return

    def leave() -> None:
        time.sleep(grace_s)
        os._exit(70)  # EX_SOFTWARE

    threading.Thread(target=leave, name="engine-died-exit", daemon=True).start()
