"""Warm starts started by the router: every new worker incarnation pulls the fleet's hottest
prefixes from its peers (``worker/pull/warm.py``).

The router watches the index's registry: a worker id it has not seen, or a known one with a
new epoch (Ray restarted it, or it was replaced), gets one ``auto_warm_start`` call naming
the other live workers as its peers. The workers of its first look are left alone: in a
fresh cluster nobody served anything yet, and a restarted router finds them warm (a worker
that restarted while no router ran is not warmed). The call runs on the worker while it
takes load, so nothing waits for it: not the worker's readiness, not a request. The worker
runs it once per incarnation, so the calls of several routers cost one warm start. Without
an index there are no epochs and no warm starts. A call that fails is logged and not
repeated for that incarnation. Never raises.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import ray

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WarmStarter:
    """Polls ``live_epochs`` every ``poll_s`` and starts the warm starts (see the module)."""

    namespace: str  # the cluster's Ray namespace (the workers' actors are named in it)
    live_epochs: Callable[[], Awaitable[Mapping[str, int]]]  # the registry: worker -> epoch
    _: KW_ONLY
    prefixes: int  # the fleet's hottest prefixes a new worker pulls
    share: float  # of its device KV blocks, at most, filled by them
    poll_s: float = 0.5
    call_timeout_s: float = 300.0
    seen: dict[str, int] = field(default_factory=dict, init=False)  # worker -> epoch asked
    # worker -> what its last warm start did
    results: dict[str, dict[str, int]] = field(default_factory=dict, init=False)
    _calls: set[asyncio.Task] = field(default_factory=set, init=False)

    async def run(self) -> None:
        """Until cancelled; cancels the calls in flight when it is."""
        try:
            while True:
                await self.poll()
                await asyncio.sleep(self.poll_s)
        finally:
            for task in self._calls:
                task.cancel()

    async def poll(self) -> list[str]:
        """One look at the registry; returns the workers whose warm start it asked for."""
        try:
            live = dict(await self.live_epochs())
        except Exception as exc:  # noqa: BLE001 - the index may be away: look again later
            log.debug("warm start: no registry (%r)", exc)
            return []
        if not self.seen:  # the fleet this router starts with: nothing to warm it from
            self.seen.update(live)  # (a fresh cluster) or already warm (a restarted router)
            return []
        new = [w for w, epoch in sorted(live.items()) if self.seen.get(w) != epoch]
        for worker in new:
            self.seen[worker] = live[worker]
            peers = sorted(w for w in live if w != worker)
            task = asyncio.get_running_loop().create_task(self._ask(worker, peers))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        return new

    async def _ask(self, worker: str, peers: list[str]) -> None:
        try:
            loop = asyncio.get_running_loop()
            handle = await loop.run_in_executor(
                None, lambda: ray.get_actor(worker, namespace=self.namespace)
            )
            call = handle.auto_warm_start.remote(peers, self.prefixes, self.share)
            done = await asyncio.wait_for(_await(call), self.call_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a worker that died warms nothing
            log.info("warm start of %s not done: %r", worker, exc)
            return
        self.results[worker] = done
        if done.get("blocks"):
            log.info("worker %s warm-started from %s: %s", worker, ", ".join(peers), done)


async def _await(ref: Any) -> Any:
    return await ref
