"""Stored Responses API responses, in the cluster's Redis: what ``previous_response_id``,
``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}`` read, from whichever router a
client reaches (every node runs routers; a response made through one is continued through
another).

A record is the response object and the conversation it ended (its input messages, earlier
ones included, and its answer as the assistant's turn; a response's ``instructions`` are
not carried into the next one, as OpenAI's API has it), as JSON under a key of the tenant's:
a tenant never reads (or learns of) another tenant's responses. Records expire after
``router.responses_ttl_s``. Redis is called off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import redis

from router.serving.request_errors import StoreUnavailable

log = logging.getLogger(__name__)
MAX_RECORD_BYTES = 2 << 20  # a longer conversation (over max_prompt_chars) is answered, not kept


class ResponseStore:
    """One router's access to the stored responses (``client``: the cluster's Redis;
    ``prefix``: the cluster's key namespace)."""

    def __init__(self, client: redis.Redis, prefix: str, ttl_s: float) -> None:
        self.client = client
        self.prefix = prefix + "resp:"
        self.ttl_ms = max(1, int(ttl_s * 1000))

    def _key(self, tenant: str | None, response_id: str) -> str:
        return f"{self.prefix}{tenant or ''}:{response_id}"

    async def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"the response store (Redis) did not answer: {exc}") from exc

    async def put(
        self,
        tenant: str | None,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
    ) -> bool:
        """Keep ``response`` and its conversation; False when it was not kept (too large,
        or Redis did not answer: logged; the answer itself is not affected)."""
        data = json.dumps({"response": response, "messages": messages}, ensure_ascii=False)
        if len(data) > MAX_RECORD_BYTES:
            log.warning("response %s not stored: %d bytes", response["id"], len(data))
            return False
        try:
            key = self._key(tenant, response["id"])
            await self._call(lambda: self.client.set(key, data, px=self.ttl_ms))
        except StoreUnavailable as exc:
            log.warning("response %s not stored: %s", response["id"], exc)
            return False
        return True

    async def get(self, tenant: str | None, response_id: str) -> dict[str, Any] | None:
        """The record (``response``, ``messages``), or None when there is none for ``tenant``."""
        data = await self._call(self.client.get, self._key(tenant, response_id))
        return None if data is None else json.loads(data)

    async def delete(self, tenant: str | None, response_id: str) -> bool:
        return bool(await self._call(self.client.delete, self._key(tenant, response_id)))

    def close(self) -> None:
        self.client.close()
