"""Stored Responses API responses, in the cluster's Redis: what ``previous_response_id``,
``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}`` read, from whichever router a
client reaches (every node runs routers; a response made through one is continued through
another).

A record is the response object and the conversation it ended (its input messages, earlier
ones included, and its answer as the assistant's turn; a response's ``instructions`` are
not carried into the next one, as OpenAI's API has it), as JSON under a key of the tenant's:
a tenant never reads (or learns of) another tenant's responses. Records expire after
``router.responses_ttl_s``; a tenant keeps at most ``router.responses_max_tenant_bytes`` at
once (past it, new responses are answered with ``store: false``), so no tenant can fill the
Redis the global index needs. Redis is called off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import redis

from router.serving.request_errors import StoreUnavailable

log = logging.getLogger(__name__)
MAX_RECORD_BYTES = 2 << 20  # a longer conversation (over max_prompt_chars) is answered, not kept
_ID = re.compile(
    r"resp_[0-9a-f]{32}"
)  # the ids this server makes (responses_request.parse_responses)

# Each tenant's records are indexed by expiry (a sorted set) with their sizes (a hash) and
# the sum of the live ones (a counter): the budget check and every change first drop what
# expired. Keys: 1 the tenant's index, 2 its sizes, 3 its byte count (4: the record).
_DROP_EXPIRED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, id in ipairs(gone) do
  local size = redis.call('HGET', KEYS[2], id)
  if size then redis.call('DECRBY', KEYS[3], size) end
  redis.call('HDEL', KEYS[2], id)
end
if #gone > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now) end
"""
# ARGV: id, record, ttl ms. Returns 1.
_PUT = (
    _DROP_EXPIRED
    + """
local size = string.len(ARGV[2])
redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old then redis.call('DECRBY', KEYS[3], old) end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], size)
redis.call('INCRBY', KEYS[3], size)
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return 1
"""
)
# Returns the tenant's live bytes.
_USED = _DROP_EXPIRED + "return tonumber(redis.call('GET', KEYS[3]) or '0')"
# ARGV: id. Returns 1 when there was a record.
_DELETE = (
    _DROP_EXPIRED
    + """
local size = redis.call('HGET', KEYS[2], ARGV[1])
if size then redis.call('DECRBY', KEYS[3], size) end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return redis.call('DEL', KEYS[4])
"""
)


class ResponseStore:
    """One router's access to the stored responses (``client``: the cluster's Redis;
    ``prefix``: the cluster's key namespace, one hash slot; ``tenant_bytes``: the most a
    tenant keeps at once)."""

    def __init__(self, client: redis.Redis, prefix: str, ttl_s: float, tenant_bytes: int) -> None:
        self.client = client
        self.prefix = prefix + "resp:"
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.tenant_bytes = tenant_bytes
        self._put = client.register_script(_PUT)
        self._used = client.register_script(_USED)
        self._delete = client.register_script(_DELETE)

    def _keys(self, tenant: str | None, response_id: str = "") -> list[str]:
        # the tenant's name is hex-encoded: no name (or id) can reach another's keys
        t = f"{self.prefix}{(tenant or '').encode().hex()}:"
        return [t + "idx", t + "sizes", t + "bytes", t + "r:" + response_id]

    async def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"the response store (Redis) did not answer: {exc}") from exc

    async def has_room(self, tenant: str | None) -> bool:
        """Whether ``tenant`` keeps less than its budget now (a response that begins now
        is kept; the budget is soft by the responses in flight)."""
        try:
            used = await self._call(lambda: self._used(keys=self._keys(tenant)[:3]))
        except StoreUnavailable as exc:
            log.warning("response store: %s", exc)
            return False
        return int(used) < self.tenant_bytes

    async def put(
        self,
        tenant: str | None,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
    ) -> bool:
        """Keep ``response`` and its conversation; False when it was not kept (too large,
        or Redis did not answer: logged; the answer itself is not affected)."""
        data = json.dumps({"response": response, "messages": messages}, ensure_ascii=False)
        raw = data.encode()
        if len(raw) > MAX_RECORD_BYTES:
            log.warning("response %s not stored: %d bytes", response["id"], len(raw))
            return False
        keys = self._keys(tenant, response["id"])
        try:
            await self._call(lambda: self._put(keys=keys, args=[response["id"], raw, self.ttl_ms]))
        except StoreUnavailable as exc:
            log.warning("response %s not stored: %s", response["id"], exc)
            return False
        return True

    async def get(self, tenant: str | None, response_id: str) -> dict[str, Any] | None:
        """The record (``response``, ``messages``), or None when there is none for ``tenant``."""
        if not _ID.fullmatch(response_id):
            return None
        data = await self._call(self.client.get, self._keys(tenant, response_id)[3])
        return None if data is None else json.loads(data)

    async def delete(self, tenant: str | None, response_id: str) -> bool:
        if not _ID.fullmatch(response_id):
            return False
        keys = self._keys(tenant, response_id)
        return bool(await self._call(lambda: self._delete(keys=keys, args=[response_id])))

    def close(self) -> None:
        self.client.close()
