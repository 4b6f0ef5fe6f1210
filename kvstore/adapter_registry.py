"""The LoRA adapters a cluster registered at run time, kept in its Redis: a router writes an
adapter here before it asks the workers to load it (``POST /v1/load_lora_adapter``), and a
worker that starts (a restart, a new node) registers every adapter listed, so an adapter
outlives the workers that loaded it. Adapters of the cluster config are not listed: every
worker has those from its config.

One hash per (cluster, model): adapter name -> JSON ``{"path", "tenants"}`` (``tenants``:
the only tenants that may see and use it; null: every tenant).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import redis

# what an adapter may be called (workers check it at registration, routers before a load)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ADAPTER_NAME_RULE = (
    "1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
)


@dataclass(frozen=True, slots=True)
class RegisteredAdapter:
    name: str
    path: str  # the adapter's folder, the same on every node
    tenants: tuple[str, ...] | None  # None: every tenant


class AdapterRegistry:
    """The run-time adapters of one (cluster, model) index namespace (a sync client: callers
    on an event loop call it from a thread)."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self.client = client
        self.key = namespace + "loras"

    def add(self, adapter: RegisteredAdapter) -> bool:
        """Register ``adapter`` unless its name is registered already (False then): of two
        clients loading one name at once, one gets it."""
        return bool(self.client.hsetnx(self.key, adapter.name, _value(adapter)))

    def get(self, name: str) -> RegisteredAdapter | None:
        raw = self.client.hget(self.key, name)
        return None if raw is None else _adapter(name, raw)

    def remove(self, name: str) -> bool:
        return bool(self.client.hdel(self.key, name))

    def close(self) -> None:
        self.client.close()

    def all(self) -> list[RegisteredAdapter]:
        """Every registered adapter, by name."""
        raw = self.client.hgetall(self.key)
        return sorted((_adapter(_text(k), v) for k, v in raw.items()), key=lambda a: a.name)


def _value(adapter: RegisteredAdapter) -> str:
    tenants = list(adapter.tenants) if adapter.tenants is not None else None
    return json.dumps({"path": adapter.path, "tenants": tenants})


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _adapter(name: str, raw: bytes | str) -> RegisteredAdapter:
    data = json.loads(raw)
    tenants = data.get("tenants")
    return RegisteredAdapter(name, data["path"], tuple(tenants) if tenants is not None else None)
