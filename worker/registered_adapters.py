"""A starting worker registers the LoRA adapters the cluster loaded at run time
(``kvstore/adapter_registry.py``), so that a restarted worker, or one on a new node, serves
what its peers serve. Best effort: a worker never fails to start for the registry's sake."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstore.adapter_registry import AdapterRegistry

if TYPE_CHECKING:
    from worker.engine import Engine

log = logging.getLogger(__name__)


def register_from_registry(engine: Engine, registry: AdapterRegistry) -> list[str]:
    """Register every adapter ``registry`` lists with ``engine`` (before its loop starts);
    returns the names registered, in order. An adapter that fails (its folder missing on this
    node, weights this model cannot serve) is logged and skipped, and so is the whole registry
    when it cannot be read (Redis unreachable: one bounded read, the client's timeouts)."""
    try:
        adapters = registry.all()
    except Exception as exc:  # noqa: BLE001 - the worker starts without them
        log.warning("LoRA adapter registry %s not read; none registered: %r", registry.key, exc)
        return []
    registered = []
    for adapter in adapters:
        if adapter.name in engine.config.lora_adapters:
            # the cluster config's adapter of that name wins, as on every other worker
            log.warning(
                "LoRA adapter %r of the registry skipped: the cluster config registers that name",
                adapter.name,
            )
            continue
        try:
            engine.add_lora(adapter.name, adapter.path, adapter.tenants)
        except Exception as exc:  # noqa: BLE001 - one bad adapter must not stop the worker
            log.warning(
                "LoRA adapter %r of the registry (%s) skipped: %s", adapter.name, adapter.path, exc
            )
            continue
        registered.append(adapter.name)
    return registered
