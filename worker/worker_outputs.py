"""A worker's side of its requests' streams, from the claim of an id to the stream's end: the
output channels, one per calling router (``channels.py``: opened by the router's reader,
:meth:`WorkerOutputs.serve`, or its first submit, found by later submits, dropped with a dead
caller), the callers watched (``callers.py``), the live ids (``live_ids.py``) and the
collector freeze after warm-up."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from kvstore.blocks.errors import UnknownChannel
from kvstore.blocks.outputs import PackedOutput
from kvstore.blocks.pauses import WarmUpFreeze
from worker.callers import CallerWatch
from worker.channels import Channel, Channels
from worker.engine.streams import StreamEnd
from worker.live_ids import LiveIds


class WorkerOutputs:
    """The actor's loop only. ``abort(request_id)``: the engine's; ``on_loop()``: called when
    a channel gets its caller (the loop's thread takes its scheduling policy)."""

    def __init__(self, abort: Callable[[str], object], on_loop: Callable[[], None]) -> None:
        self._on_loop = on_loop
        self.callers = CallerWatch(abort, on_dead=self.caller_died)
        self.live = LiveIds()  # a second request with a live id is refused, the first unharmed
        self.channels = Channels(abort, self.stream_ended, on_drop=self.callers.forget_channel)
        self.warm_freeze = WarmUpFreeze()  # once more when idle after the first requests

    def submit_channel(self, channel_id: str, caller: Any) -> Channel:
        """The channel a submit names: a router sends only its caller's incarnation id
        once a request with the ref came back admitted (UnknownChannel if not this one)."""
        if isinstance(caller, str):
            ch = self.channels.find(channel_id)
            known = None if ch is None else ch.caller
            if getattr(known, "incarnation", None) != caller:
                raise UnknownChannel(f"output channel {channel_id!r} is not open on this worker")
            return ch  # type: ignore[return-value]
        return self._channel(channel_id, caller)

    async def serve(
        self, channel_id: str, caller: Any, schema: str | None
    ) -> AsyncIterator[list[PackedOutput | StreamEnd]]:
        """The channel's outputs, one list per message (see ``WorkerServer.outputs``)."""
        if caller is not None:
            self._channel(channel_id, caller)
        async for items in self.channels.serve(channel_id, schema):
            yield items

    def _channel(self, channel_id: str, caller: Any) -> Channel:
        """The channel ``channel_id`` of ``caller``, watched while it is open."""
        ch = self.channels.get(channel_id)
        if ch.caller is None and caller is not None:
            ch.caller = caller
            self.callers.watch_channel(channel_id, caller)
            self._on_loop()
        return ch

    def opened(self, ch: Channel, request_id: str) -> None:
        """A request's outputs go to ``ch`` (before its add: its first outputs may come
        before the submit resumes); its caller is watched."""
        ch.open(request_id)
        self.callers.watch(request_id, ch.caller)

    def refused(self, ch: Channel, request_id: str) -> None:
        """A claimed request was not taken in: nothing of it stays."""
        ch.requests.discard(request_id)
        self.callers.forget(request_id)
        self.live.release(request_id)

    def stream_ended(self, request_id: str) -> None:
        """A request's stream ended (its last output or StreamEnd was delivered)."""
        self.callers.forget(request_id)
        self.live.release(request_id)
        self.warm_freeze.request_ended(idle=not self.live)

    def caller_died(self, caller: Any) -> None:
        """A dead router's channels have no reader any more."""
        for channel_id in self.channels.of_caller(caller):
            self.channels.drop(channel_id)
