"""The worker's side of peer pulls: export to a peer, pull from a peer, probe.

Every engine access is a command to the engine loop (``worker/engine/commands.py``), so the
actor's event loop never waits for a step; the bytes move through a
:class:`~worker.pull.transport.KVTransport`.

A pull is advice, never a dependency: whatever goes wrong — the source holds nothing any
more, it died or restarted, the object is lost, corrupt or of another model, tenant or
adapter, or the whole pull outlasts its soft deadline — the request is queued as it is and
recomputes its prefix. Nothing is left behind: the source's pins last only for its copy,
the payload is freed when the importer drops its handle, and an import is either written
and cached whole or not at all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import ray

from kvstore.blocks.hashing import BlockKey, HashContext
from kvstore.requests.protocol import PullHint, PullReport, WorkerRequest
from worker.engine.commands import ExportRun, ImportRun
from worker.kv.transfer import BlockRun, ImportRefused, RunHeader
from worker.pull.transport import (
    KVTransport,
    PullFailed,
    RayObjectStoreTransport,
    RunHandle,
    current_node_id,
)

if TYPE_CHECKING:
    from worker.engine import Engine
    from worker.engine.engine_loop import EngineLoop

log = logging.getLogger(__name__)
EXPORT_WAIT_S = 10.0  # an export that finds no window by then fails (the puller recomputes)


class PeerPulls:
    """A worker's pulls and exports, its peers' handles and the pulls in flight. ``engine``
    is read only for its fixed facts (block size, hash contexts, KV layout); everything
    else goes through ``engine_loop``."""

    def __init__(
        self,
        engine: Engine,
        engine_loop: EngineLoop,
        worker_id: str,
        namespace: str | None,  # the cluster's Ray namespace (None: the job's)
        transport: KVTransport | None = None,
    ) -> None:
        self.engine = engine
        self.engine_loop = engine_loop
        self.worker_id = worker_id
        self.namespace = namespace
        self.transport = transport or RayObjectStoreTransport()
        self.outcomes: Counter[str] = Counter()  # outcome -> pulls
        self.pulled_tokens = 0  # tokens imported by pulls
        self.exported_runs = 0  # runs this worker handed out
        self._peers: dict[str, Any] = {}  # worker id -> actor handle (cached)
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kv-pull")  # actor lookups
        self.node_id = current_node_id()
        # last key of each pull in flight -> its end: a request of the same prefix that
        # arrives meanwhile waits for it instead of computing the prefix beside the import
        self.landing: dict[BlockKey, asyncio.Future[None]] = {}
        self.coalesced = 0  # requests that waited for another request's pull

    # -- source ------------------------------------------------------------------------------

    async def export_kv(
        self, keys: Sequence[BlockKey], ctx: HashContext, start: int = 0
    ) -> RunHandle | None:
        """Publish the leading run of ``keys`` (blocks ``start..`` of a prompt under
        ``ctx``) this worker holds; None when it holds none. Called by a pulling peer. The
        copy runs while this worker's model computes its step (``worker/engine/forward_window.py``):
        a busy holder makes a pull wait for no step of its own."""
        run = await self.engine_loop.export_async(ExportRun(tuple(keys), ctx, start), EXPORT_WAIT_S)
        if run is None:
            return None
        self.exported_runs += 1
        return self.transport.publish(run)

    async def probe_export(self, n_tokens: int, max_bytes: int = 64 << 20) -> RunHandle | None:
        """Publish a zero run of ``n_tokens`` (whole blocks, at most ``max_bytes``) in this
        worker's KV layout: the bytes a real pull of that length moves (the router's
        transfer calibration)."""
        from worker.model.kv_run import run_block_bytes, zero_payload

        layout = self.engine.executor.kv_layout
        if layout is None:
            return None
        per_block = run_block_bytes(layout)
        n_blocks = max(1, min(n_tokens // layout.block_size, max_bytes // per_block))
        header = RunHeader(layout, HashContext(), 0, (), ())
        return self.transport.publish(BlockRun(header, zero_payload(layout, n_blocks)))

    async def probe_pull(
        self, source_id: str, sizes: Sequence[int], repeats: int = 3
    ) -> dict[str, Any]:
        """Time pulls of zero runs of ``sizes`` tokens from ``source_id`` (call, publish,
        fetch and a copy of the bytes, as an import copies them), the fastest of
        ``repeats`` each (the rest is noise): the router fits its transfer cost for this
        pair of nodes to the samples."""
        source = await self.peer(source_id)
        samples: list[tuple[int, float]] = []
        source_node = ""
        bs = self.engine.config.block_size
        for n in sizes:
            best, tokens = None, 0
            for _ in range(repeats):
                started = time.monotonic()
                handle = await asyncio.wait_for(_await(source.probe_export.remote(n)), 30.0)
                if handle is None:
                    return {"source_node": "", "node": self.node_id, "samples": []}
                run = await self.transport.fetch(handle, 30.0)
                run.payload.data.copy()  # the import's copy into the cache
                took = time.monotonic() - started
                best = took if best is None else min(best, took)
                tokens = len(run.payload) * bs
                self.transport.release(handle)
                source_node = handle.node
            samples.append((tokens, best))
        return {"source_node": source_node, "node": self.node_id, "samples": samples}

    # -- importer ----------------------------------------------------------------------------

    async def pull_for(self, request: WorkerRequest, keys: Sequence[BlockKey]) -> PullReport | None:
        """Run the request's pull, if it has one, or wait for a pull in flight that brings
        its prefix; never raises (see the module docstring)."""
        hint = request.pull
        if hint is None:
            await self._await_landing(keys)
            return None
        ctx = self.engine.hash_context(request.params)
        started = time.monotonic()
        end = hint.start_block + hint.num_blocks
        last = keys[end - 1] if 0 < end <= len(keys) else None
        landing = asyncio.get_running_loop().create_future()
        if last is not None:
            self.landing.setdefault(last, landing)
        try:
            outcome, blocks, nbytes, node = await self._pull(hint, request.token_ids, keys, ctx)
        finally:
            landing.set_result(None)
            if last is not None and self.landing.get(last) is landing:
                del self.landing[last]
        seconds = time.monotonic() - started
        self.outcomes[outcome] += 1
        if outcome != "ok":
            log.info(
                "request %s: pull from %s %s after %.3fs; recomputing",
                request.request_id,
                hint.source_id,
                outcome,
                seconds,
            )
        bs = self.engine.config.block_size
        return PullReport(
            hint.source_id, outcome, blocks, blocks * bs, seconds, nbytes, self.node_id, node
        )

    async def _await_landing(self, keys: Sequence[BlockKey]) -> None:
        """Wait for a pull in flight that brings a prefix of ``keys`` (it ends by its own
        deadline, so this never waits longer than that)."""
        if not self.landing:
            return
        for key in reversed(keys):
            landing = self.landing.get(key)
            if landing is not None:
                self.coalesced += 1
                await asyncio.shield(landing)
                return

    async def _pull(
        self,
        hint: PullHint,
        token_ids: Sequence[int],
        keys: Sequence[BlockKey],
        ctx: HashContext,
    ) -> tuple[str, int, int, str]:
        """(outcome, blocks imported, payload bytes, the source's node id)."""
        deadline = time.monotonic() + hint.deadline_s
        want = list(keys[hint.start_block : hint.start_block + hint.num_blocks])
        if not want or hint.source_id == self.worker_id:
            return "missing", 0, 0, ""
        try:
            source = await self.peer(hint.source_id)
            call = source.export_kv.remote(want, ctx, hint.start_block)
            handle = await asyncio.wait_for(_await(call), max(deadline - time.monotonic(), 0))
            if handle is None:
                return "missing", 0, 0, ""
            run = await self.transport.fetch(handle, deadline - time.monotonic())
        except PullFailed as exc:
            return exc.outcome, 0, 0, ""
        except TimeoutError:
            return "timeout", 0, 0, ""
        except Exception as exc:  # noqa: BLE001 - a dead, restarting or unknown source
            self._peers.pop(hint.source_id, None)
            log.debug("pull from %s failed: %r", hint.source_id, exc)
            return "source-gone", 0, 0, ""
        try:
            res = await self.engine_loop.call_async(ImportRun(run, token_ids, ctx, keys))
        except ImportRefused as exc:
            log.warning("run from %s refused: %s", hint.source_id, exc.reason)
            return "refused", 0, handle.nbytes, handle.node
        except Exception:  # noqa: BLE001 - never fail the request for its pull: recompute
            log.exception("import of a run from %s failed; recomputing", hint.source_id)
            return "refused", 0, handle.nbytes, handle.node
        finally:
            self.transport.release(handle)
        self.pulled_tokens += res.blocks * self.engine.config.block_size
        return "ok", res.blocks, handle.nbytes, handle.node

    async def peer(self, worker_id: str) -> Any:
        """The peer's actor handle (named actors of this namespace; looked up off the loop)."""
        handle = self._peers.get(worker_id)
        if handle is None:
            loop = asyncio.get_running_loop()
            handle = await loop.run_in_executor(
                self._lookups, lambda: ray.get_actor(worker_id, namespace=self.namespace)
            )
            self._peers[worker_id] = handle
        return handle

    def stats(self) -> dict[str, Any]:
        """Pulls by outcome, tokens imported, runs exported, requests coalesced."""
        return {
            "outcomes": dict(self.outcomes),
            "pulled_tokens": self.pulled_tokens,
            "exported_runs": self.exported_runs,
            "coalesced": self.coalesced,
        }


async def _await(ref: Any) -> Any:
    return await ref
