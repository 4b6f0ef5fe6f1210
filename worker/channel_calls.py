"""The worker actor's output channels, one per calling router (``channels.py``): opened by
the router's reader (:meth:`ChannelCalls.outputs`) or its first submit, found by later
submits, dropped with a dead caller; and the end of each request's stream.

:class:`ChannelCalls` is mixed into the worker actor."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvstore.blocks.errors import UnknownChannel
from kvstore.blocks.outputs import OUTPUT_SCHEMA, PackedOutput
from kvstore.blocks.pauses import WarmUpFreeze
from kvstore.blocks.wire import check_schema
from worker.callers import CallerWatch
from worker.channels import Channel, Channels
from worker.engine.streams import StreamEnd
from worker.live_ids import LiveIds


class ChannelCalls:
    """Mixin of the worker actor: needs its ``channels``, ``callers``, ``live`` and
    ``warm_freeze``, and its ``_on_loop``."""

    channels: Channels
    callers: CallerWatch
    live: LiveIds
    warm_freeze: WarmUpFreeze

    def _submit_channel(self, channel_id: str, caller: Any) -> Channel:
        """The channel a submit names: a router sends only its caller's incarnation id
        once a request with the ref came back admitted (UnknownChannel if not this one)."""
        if isinstance(caller, str):
            ch = self.channels.find(channel_id)
            known = None if ch is None else ch.caller
            if getattr(known, "incarnation", None) != caller:
                raise UnknownChannel(f"output channel {channel_id!r} is not open on this worker")
            return ch  # type: ignore[return-value]
        return self._channel(channel_id, caller)

    async def outputs(
        self, channel_id: str, caller: Any = None, schema: str | None = None
    ) -> AsyncIterator[list[PackedOutput | StreamEnd]]:
        """The channel's outputs, one list per message: every output of each request sent
        with this ``channel_id``, in order (packed: ``unpack_output``); a
        :class:`StreamEnd` ends a request whose engine stopped. Ends when the caller stops
        reading or dies, idle or not (its open requests are aborted).

        ``schema``: the caller's ``OUTPUT_SCHEMA``; a router of another packed layout is
        refused with :class:`WireMismatch`."""
        check_schema("output channel", schema, OUTPUT_SCHEMA)  # refused: nothing is opened
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

    def _stream_ended(self, request_id: str) -> None:
        """A request's stream ended (its last output or StreamEnd was delivered)."""
        self.callers.forget(request_id)
        self.live.release(request_id)
        self.warm_freeze.request_ended(idle=not self.live)

    def _caller_died(self, caller: Any) -> None:
        """A dead router's channels have no reader any more."""
        for channel_id in self.channels.of_caller(caller):
            self.channels.drop(channel_id)
