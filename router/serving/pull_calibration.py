"""Start-up calibration of the router's transfer model: time real pulls between workers.

Once at least two workers are live, the router asks each worker but the first to pull zero
runs of a few sizes from the first (the bytes of real runs through the same transport,
``PeerPulls.probe_pull``) and fits fixed + per-token cost to the samples for that pair of
nodes; every later pull refines it (``TransferModel.observe``). A worker that does not
answer is skipped: the defaults of ``routing.pull`` stand for its pair until it is probed
or a real pull is observed. Never raises into the router.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import ray

from router.placement.router import Router

log = logging.getLogger(__name__)


async def calibrate_transfers(
    router: Router,
    namespace: str,
    live_workers: Callable[[], Awaitable[Mapping[str, Any]]],
    *,
    sizes: Sequence[int] = (256, 1 << 20),  # tokens; the worker caps a probe at 64 MiB
    max_probes: int = 8,
    wait_s: float = 60.0,
    poll_s: float = 0.5,
    timeout_s: float = 30.0,
) -> int:
    """Probe pulls and calibrate ``router.planner.transfers``; returns the pairs fitted."""
    planner = router.planner
    if planner is None:
        return 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    workers: list[str] = []
    while loop.time() < deadline:
        try:
            workers = sorted(await live_workers())
        except Exception:  # noqa: BLE001 - the directory may not be ready yet
            workers = []
        if len(workers) >= 2:
            break
        await asyncio.sleep(poll_s)
    if len(workers) < 2:
        return 0
    source, fitted = workers[0], set()
    for dst in workers[1 : 1 + max_probes]:
        try:
            handle = await loop.run_in_executor(None, lambda d=dst: ray.get_actor(d, namespace))
            probe = await asyncio.wait_for(
                _await(handle.probe_pull.remote(source, list(sizes))), timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - calibration is best effort
            log.info("transfer probe %s -> %s failed: %r", source, dst, exc)
            continue
        router.nodes[source], router.nodes[dst] = probe["source_node"], probe["node"]
        pair = (probe["source_node"], probe["node"])
        if probe["samples"] and pair not in fitted:
            cost = planner.transfers.calibrate(*pair, probe["samples"])
            fitted.add(pair)
            log.info(
                "transfer %s -> %s calibrated: %.2f ms + %.3f us/token",
                source,
                dst,
                1e3 * cost.fixed_s,
                1e6 * cost.per_token_s,
            )
    return len(fitted)


async def _await(ref: Any) -> Any:
    return await ref
