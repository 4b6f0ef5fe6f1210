"""Warm start: a new or restarted worker pulls the fleet's hottest prefixes from its peers.

Built on the worker's :class:`~worker.pull.peer.PeerPulls` (whose transport and peer
handles it uses). Each worker counts what it served
(:class:`~worker.pull.served_prefixes.ServedPrefixes`); a warm start asks every peer for
its hot list, picks the prefixes the fleet used most within a block budget (``pick_warm``)
and pulls each from a peer that offered it, checked like a request's pull (its keys must
hash from its own tokens under a context of this model and of an adapter served here). The
routers start it once per worker incarnation (``router/serving/warm_start.py``) after the
worker is ready, so it runs while the worker takes load, never before: whatever fails is
skipped, nothing fails a request, and nothing is held after it (each payload is released
as it is written).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore.blocks.hashing import BlockKey
from kvstore.requests.protocol import WorkerRequest
from worker.engine.commands import AnnounceState, ImportRun, Snapshot
from worker.pull.peer import PeerPulls
from worker.pull.served_prefixes import HotPrefix, ServedPrefixes, pick_warm

if TYPE_CHECKING:
    from worker.engine import Engine
    from worker.engine.engine_loop import EngineLoop

log = logging.getLogger(__name__)
CALL_S = 30.0  # one peer call or fetch of a warm start


class WarmStarts:
    """What a worker served, and its warm start through ``pulls`` (peers and transport)."""

    def __init__(self, engine: Engine, engine_loop: EngineLoop, pulls: PeerPulls) -> None:
        self.engine = engine
        self.engine_loop = engine_loop
        self.pulls = pulls
        self.worker_id = pulls.worker_id
        self.served = ServedPrefixes()  # what this worker served: its peers' warm starts
        self.warmed_blocks = 0  # blocks imported by warm starts
        self._auto_warm: asyncio.Future[dict[str, int]] | None = None  # once per incarnation

    def note_served(self, request: WorkerRequest, keys: Sequence[BlockKey]) -> None:
        usable = (len(request.token_ids) - 1) // self.engine.config.block_size
        if usable > 0:
            self.served.note(self.engine.hash_context(request.params), keys[:usable])

    def stats(self) -> dict[str, Any]:
        """Blocks warmed, and whether the warm start of this incarnation ended."""
        return {
            "warmed_blocks": self.warmed_blocks,
            "warm_started": self._auto_warm is not None and self._auto_warm.done(),
        }

    def hot_prefixes(self, n: int) -> list[HotPrefix]:
        """The ``n`` prefixes this worker served most (see ``ServedPrefixes.hot``)."""
        return self.served.hot(n)

    async def auto_warm_start(
        self, peer_ids: Sequence[str], n: int, share: float
    ) -> dict[str, int]:
        """:meth:`warm_start` once per incarnation of this worker, within ``share`` of its
        device blocks; every later call (another router, a restarted router) gets the first
        one's result. Never raises."""
        if self._auto_warm is None:
            self._auto_warm = asyncio.ensure_future(self._warm_quietly(peer_ids, n, share))
        return await asyncio.shield(self._auto_warm)

    async def _warm_quietly(self, peer_ids: Sequence[str], n: int, share: float) -> dict:
        try:
            total = (await self.engine_loop.call_async(Snapshot())).total_blocks
            return await self.warm_start(peer_ids, n, int(share * total))
        except Exception:  # noqa: BLE001 - a warm start is an optimisation, never a failure
            log.exception("worker %s: warm start failed", self.worker_id)
            return {"runs": 0, "blocks": 0, "skipped": 0, "failed": 1}

    async def warm_start(
        self, peer_ids: Sequence[str], n: int = 16, max_blocks: int | None = None
    ) -> dict[str, int]:
        """Pull the fleet's ``n`` hottest prefixes (of ``peer_ids``' hot lists), at most
        ``max_blocks`` blocks in all (None: no bound). ``skipped``: peers that did not
        answer and prefixes no peer could give or this worker cannot use."""
        done = {"runs": 0, "blocks": 0, "skipped": 0}
        peers = [p for p in dict.fromkeys(peer_ids) if p != self.worker_id]
        lists = await asyncio.gather(*(self._hot_of(p, n) for p in peers))
        offers = [(p, hot) for p, hot in zip(peers, lists, strict=True) if hot is not None]
        done["skipped"] += len(peers) - len(offers)
        served = set(self.engine.loras.values())
        budget = max_blocks if max_blocks is not None else 1 << 62
        for hot, sources in pick_warm(offers, n, budget):
            ctx = hot.ctx
            if ctx.model_id != self.engine.model_id or (
                ctx.lora_id is not None and ctx.lora_id not in served
            ):
                done["skipped"] += 1
                continue
            for source in sources:
                blocks = await self._warm_one(source, hot)
                if blocks is not None:
                    done["runs"] += 1
                    done["blocks"] += blocks
                    break
            else:
                done["skipped"] += 1
        self.warmed_blocks += done["blocks"]
        if done["blocks"]:  # an idle engine steps not: announce the imports to the index now
            await self.engine_loop.call_async(AnnounceState())
        bs = self.engine.config.block_size
        log.info("worker %s warm start: %s (%d tokens)", self.worker_id, done, done["blocks"] * bs)
        return done

    async def _hot_of(self, peer_id: str, n: int) -> list[HotPrefix] | None:
        try:
            peer = await self.pulls.peer(peer_id)
            return await asyncio.wait_for(_await(peer.hot_prefixes.remote(n)), CALL_S)
        except Exception:  # noqa: BLE001 - a peer that does not answer warms nothing
            return None

    async def _warm_one(self, source: str, hot: HotPrefix) -> int | None:
        """Blocks imported from ``source`` for ``hot`` (None: it gave nothing usable)."""
        handle = None
        try:
            peer = await self.pulls.peer(source)
            call = peer.export_kv.remote(list(hot.keys), hot.ctx)
            handle = await asyncio.wait_for(_await(call), CALL_S)
            if handle is None:
                return None
            run = await self.pulls.transport.fetch(handle, CALL_S)
            # the run's own tokens (and one more: a hit never covers a prompt's last token)
            prompt = [t for block in run.header.token_ids for t in block] + [0]
            res = await self.engine_loop.call_async(ImportRun(run, prompt, hot.ctx))
            return res.blocks
        except Exception as exc:  # noqa: BLE001 - refused, gone, timed out: skip it
            log.info("worker %s: warm pull from %s skipped: %r", self.worker_id, source, exc)
            return None
        finally:
            if handle is not None:
                self.pulls.transport.release(handle)


async def _await(ref: Any) -> Any:
    return await ref
