"""LoRA adapters in routing: resolve a request's adapter name to its stable id, and keep
only the workers that serve it.

Workers report the ids of the adapters they serve (``name@digest``) and which are in a device
slot with every heartbeat (``WorkerLoad.lora_ids`` / ``lora_loaded``). The id, not the name,
goes into block 0's key, so the router's keys equal the workers' and a prefix cached under
one adapter never counts for another.

An adapter registered for some tenants (``WorkerLoad.lora_owners``) exists for them only:
:func:`for_tenant` takes it out of every other tenant's view of the workers before its name
is listed or resolved, so they neither see it nor run it (it is an unknown adapter to them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

from kvstore.index_types import WorkerLoad
from kvstore.requests.errors import InvalidRequest


def adapter_name(adapter_id: str) -> str:
    return adapter_id.split("@", 1)[0]


def visible_to(tenant: str | None, load: WorkerLoad) -> tuple[str, ...]:
    """The adapter ids of ``load`` that ``tenant`` may see and use: those registered for no
    tenant in particular, and those registered for it (None, no auth: the former only)."""
    if not load.lora_owners:
        return load.lora_ids
    owned: dict[str, set[str]] = {}
    for entry in load.lora_owners:
        adapter_id, _, owner = entry.partition("=")
        owned.setdefault(adapter_id, set()).add(owner)
    return tuple(i for i in load.lora_ids if i not in owned or tenant in owned[i])


def for_tenant(loads: Mapping[str, WorkerLoad], tenant: str | None) -> dict[str, WorkerLoad]:
    """The workers as ``tenant`` sees them: the adapters of other tenants left out."""
    out = {}
    for w, ld in loads.items():
        ids = visible_to(tenant, ld)
        if ids != ld.lora_ids:
            ld = replace(ld, lora_ids=ids, lora_loaded=tuple(i for i in ld.lora_loaded if i in ids))
        out[w] = ld
    return out


def resolve_adapter(name: str, loads: Mapping[str, WorkerLoad]) -> str:
    """The stable id of adapter ``name`` among live workers; the most common one if workers
    disagree (a re-registration in progress). Unknown: ``InvalidRequest`` naming it."""
    ids = Counter(i for ld in loads.values() for i in ld.lora_ids if adapter_name(i) == name)
    if not ids:
        served = sorted({adapter_name(i) for ld in loads.values() for i in ld.lora_ids})
        raise InvalidRequest(
            "lora", name, f"unknown adapter; live workers serve: {', '.join(served) or 'none'}"
        )
    return min(ids, key=lambda i: (-ids[i], i))


def serving(adapter_id: str | None, loads: Mapping[str, WorkerLoad]) -> dict[str, WorkerLoad]:
    """The workers that can run a request of ``adapter_id`` (all for the base model)."""
    if adapter_id is None:
        return dict(loads)
    return {w: ld for w, ld in loads.items() if adapter_id in ld.lora_ids}
