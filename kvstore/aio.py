"""AsyncKVIndex: the router-side read path of the index for asyncio code (grpc.aio servers).

Same scripts, keys and errors as :class:`~kvstore.index.KVIndex`, without blocking the event
loop. Writers (workers) use the sync client from their publisher thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore import scripts
from kvstore.blocks.hashing import BlockKey
from kvstore.codec import decode_live, decode_lookup, decode_lookup_tiers, guard_async, key_blob
from kvstore.config import IndexConfig, make_async_client
from kvstore.events import sampled
from kvstore.types import WorkerInfo


class AsyncKVIndex:
    """``lookup`` and ``live_workers`` as coroutines; raise :class:`IndexUnavailable`."""

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        self._client = make_async_client(config)
        self._reg_key = config.namespace + "reg"
        self._lookup = self._client.register_script(scripts.LOOKUP[config.lookup])
        self._lookup_tiers = self._client.register_script(scripts.LOOKUP_TIERS[config.lookup])
        self._live = self._client.register_script(scripts.LIVE)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _run(self, script: Any, *args: object) -> Any:
        return await guard_async(script(keys=[self._reg_key], args=list(args)))

    async def lookup(self, keys: Sequence[BlockKey]) -> dict[str, int]:
        """See :meth:`kvstore.index.KVIndex.lookup`."""
        k = self.config.record_every
        return decode_lookup(await self._run(self._lookup, key_blob(sampled(keys, k))), k)

    async def lookup_tiers(self, keys: Sequence[BlockKey]) -> dict[str, tuple[int, int]]:
        """See :meth:`kvstore.index.KVIndex.lookup_tiers`."""
        k = self.config.record_every
        reply = await self._run(self._lookup_tiers, key_blob(sampled(keys, k)))
        return decode_lookup_tiers(reply, k)

    async def live_workers(self) -> dict[str, WorkerInfo]:
        """See :meth:`kvstore.index.KVIndex.live_workers`."""
        return decode_live(await self._run(self._live))
