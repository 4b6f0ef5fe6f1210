"""How an exported block run travels from the worker that holds it to the one importing it.

:class:`KVTransport` is the whole interface the worker's pull path uses, so another path
(GPU to GPU over NIXL or NCCL, where the payload would stay in device memory) replaces
:class:`RayObjectStoreTransport` without touching the router, the engine or the KV manager.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import (
    GetTimeoutError,
    ObjectFetchTimedOutError,
    ObjectLostError,
    OwnerDiedError,
    RayError,
)

from worker.kv.transfer import BlockRun


class PullFailed(Exception):
    """A run could not be fetched: ``outcome`` is "missing", "source-gone" or "timeout"."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(f"{outcome}: {detail}")
        self.outcome = outcome
        self.detail = detail

    def __reduce__(self) -> tuple:  # Ray moves it between processes: rebuilt from its fields
        return type(self), (self.outcome, self.detail), self.__dict__


@dataclass(frozen=True, slots=True)
class RunHandle:
    """A published run, as the importer receives it: small and picklable."""

    ref: Any  # the transport's reference to the payload (an ObjectRef for Ray)
    blocks: int  # blocks in the run
    nbytes: int  # payload bytes
    node: str = ""  # the source's node id


class KVTransport(ABC):
    """Moves a :class:`BlockRun` between two workers.

    Obligations of an implementation:

    - ``publish`` runs on the source after the engine copied the run out (never under the
      engine's lock, so it may take as long as a put takes) and returns a handle the
      importer can use while the source lives. The source keeps nothing after returning
      it: once the importer calls ``release`` (or dies) the payload's memory is freed.
    - ``fetch`` runs on the importer's event loop and either returns the very run that was
      published or raises :class:`PullFailed` — it never waits past ``timeout_s`` and never
      returns a partial run (a torn one is refused by the importer's checks anyway).
    - ``release`` is idempotent and never raises.
    """

    name: str

    @abstractmethod
    def publish(self, run: BlockRun) -> RunHandle:
        """Make ``run`` fetchable; return its handle."""

    @abstractmethod
    async def fetch(self, handle: RunHandle, timeout_s: float) -> BlockRun:
        """The run behind ``handle``, within ``timeout_s`` seconds, or :class:`PullFailed`."""

    @abstractmethod
    def release(self, handle: RunHandle) -> None:
        """The importer is done with ``handle``."""


class RayObjectStoreTransport(KVTransport):
    """Ray's object store: ``ray.put`` on the source (shared memory on its node), the
    ObjectRef to the importer, whose ``await`` maps it on the same node or has Ray's object
    manager move it between nodes. The source owns the object: if it dies, the fetch fails
    with "source-gone" (and the object goes with it, so nothing leaks)."""

    name = "ray"

    def publish(self, run: BlockRun) -> RunHandle:
        nbytes = int(getattr(getattr(run.payload, "data", None), "nbytes", 0))
        return RunHandle(ray.put(run), len(run.header), nbytes, current_node_id())

    async def fetch(self, handle: RunHandle, timeout_s: float) -> BlockRun:
        try:
            run = await asyncio.wait_for(_await_ref(handle.ref), max(timeout_s, 0.0))
        except (TimeoutError, GetTimeoutError, ObjectFetchTimedOutError) as exc:
            raise PullFailed("timeout", f"no run within {timeout_s:.3f}s") from exc
        except (OwnerDiedError, ObjectLostError) as exc:
            raise PullFailed("source-gone", str(exc).splitlines()[0]) from exc
        except RayError as exc:
            raise PullFailed("source-gone", f"{type(exc).__name__}") from exc
        if not isinstance(run, BlockRun):
            raise PullFailed("missing", f"object is a {type(run).__name__}, not a block run")
        return run

    def release(self, handle: RunHandle) -> None:
        # Dropping the last reference frees the object; a handle is only held by the caller.
        return None


async def _await_ref(ref: Any) -> Any:
    return await ref


def current_node_id() -> str:
    """This process's Ray node id ("" outside Ray)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
