"""Aborting the requests, and closing the output channels, of routers that died."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ray.exceptions import ActorDiedError

from kvstore.requests.protocol import CallerRef

log = logging.getLogger(__name__)


class CallerWatch:
    """Aborts the requests of callers (routers) that died while their streams ran, and
    tells the owner of their output channels.

    A router that dies leaves its streams without a reader, and Ray does not stop an actor
    task whose caller is gone: without this, the requests would run to ``max_tokens`` and
    hold their KV blocks until then, and a channel (a long-lived Ray stream that yields only
    when outputs come) would stay open forever once idle. Every ``interval_s`` the watch
    pings each distinct caller with an open request or channel; a caller Ray reports dead
    gets its requests aborted, then ``on_dead(caller)`` (the worker drops its channels).
    A slow or unreachable caller is not treated as dead (only ``ActorDiedError`` is).
    Runs on the actor's event loop; ``watch``/``forget`` are called per request,
    ``watch_channel``/``forget_channel`` per channel.
    """

    def __init__(
        self,
        abort: Callable[[str], object],
        *,
        interval_s: float = 0.25,  # one ping per distinct caller: cheap, and orphans stop fast
        ping_timeout_s: float = 10.0,
        on_dead: Callable[[Any], object] | None = None,
    ) -> None:
        """``on_dead(caller)``: after a dead caller's requests were aborted."""
        self._abort = abort
        self._on_dead = on_dead
        self.interval_s = interval_s
        self.ping_timeout_s = ping_timeout_s
        self._callers: dict[str, Any] = {}  # request id -> caller's actor handle
        self._channels: dict[str, Any] = {}  # channel id -> its caller
        self._task: asyncio.Task | None = None
        self.aborted = 0  # requests aborted because their caller died

    def watched_requests(self) -> dict[str, Any]:
        """Request id -> its caller, for each request watched now (a copy)."""
        return dict(self._callers)

    def watched_channels(self) -> dict[str, Any]:
        """Channel id -> its caller, for each open channel watched now (a copy)."""
        return dict(self._channels)

    def watch(self, request_id: str, caller: Any) -> None:
        if caller is None:
            return
        self._callers[request_id] = caller
        self._ensure_running()

    def forget(self, request_id: str) -> None:
        self._callers.pop(request_id, None)

    def watch_channel(self, channel_id: str, caller: Any) -> None:
        """Watch ``caller`` while its channel is open, requests or not."""
        if caller is None:
            return
        self._channels[channel_id] = caller
        self._ensure_running()

    def forget_channel(self, channel_id: str) -> None:
        self._channels.pop(channel_id, None)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._callers or self._channels:
            await asyncio.sleep(self.interval_s)
            by_caller: dict[Any, list[str]] = {}
            for caller in list(self._channels.values()):
                by_caller.setdefault(caller, [])
            for rid, caller in list(self._callers.items()):
                by_caller.setdefault(caller, []).append(rid)
            for caller, rids in by_caller.items():
                if await self._alive(caller):
                    continue
                log.warning("caller of %d request(s) died; aborting them", len(rids))
                for rid in rids:
                    self.forget(rid)
                    self._abort(rid)
                    self.aborted += 1
                for cid in [c for c, who in self._channels.items() if who == caller]:
                    self.forget_channel(cid)
                if self._on_dead is not None:
                    self._on_dead(caller)

    async def _alive(self, caller: Any) -> bool:
        """A :class:`CallerRef` is alive while its router answers with the same incarnation
        (a router Ray restarted has a new one and no reader for its predecessor's streams)."""
        try:
            if isinstance(caller, CallerRef):
                now = await asyncio.wait_for(
                    caller.handle.incarnation.remote(), self.ping_timeout_s
                )
                return now == caller.incarnation
            await asyncio.wait_for(caller.__ray_ready__.remote(), self.ping_timeout_s)
        except ActorDiedError:
            return False
        except Exception:  # noqa: BLE001 - slow or restarting: not proven dead
            return True
        return True
