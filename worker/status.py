"""What a worker reports: the load it publishes with its heartbeat (what a router weighs)
and its answer to a status call, each derived by field name from one snapshot of its engine
(:func:`~kvstore.runtime.derive.derived`): the three records name a shared figure alike."""

from __future__ import annotations

from kvstore.index_types import WorkerLoad
from kvstore.requests.protocol import AdapterInfo, WorkerStatus
from kvstore.runtime.derive import derived
from worker.engine import EngineSnapshot


def worker_load(snap: EngineSnapshot) -> WorkerLoad:
    """The load a router weighs: queued prefill work, running decodes, KV room, adapters,
    and the size of each KV tier below the device."""
    return derived(WorkerLoad, snap, tier_blocks={t: f.total_blocks for t, f in snap.tiers.items()})


def worker_status(
    worker_id: str,
    snap: EngineSnapshot,
    *,
    epoch: int | None,
    index_healthy: bool,
    model_load_s: float | None = None,
) -> WorkerStatus:
    """A worker's answer to a status call: its load, and the snapshot's other figures."""
    return derived(
        WorkerStatus,
        worker_load(snap),
        snap,
        worker_id=worker_id,
        epoch=epoch,
        index_healthy=index_healthy,
        model_load_s=model_load_s,
        swap_preemptions=snap.num_swap_preemptions,
        recompute_preemptions=snap.num_preemptions - snap.num_swap_preemptions,
        adapters=tuple(
            AdapterInfo(
                i.split("@")[0],
                i,
                i in snap.lora_loaded,
                tuple(o.split("=", 1)[1] for o in snap.lora_owners if o.split("=", 1)[0] == i),
            )
            for i in snap.lora_ids
        ),
    )
