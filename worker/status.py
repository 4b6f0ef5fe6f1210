"""What a worker reports: the load it publishes with its heartbeat (what a router weighs)
and its answer to a status call, each from one snapshot of its engine."""

from __future__ import annotations

from kvstore.blocks.protocol import AdapterInfo, WorkerStatus
from kvstore.types import WorkerLoad
from worker.engine import EngineSnapshot


def worker_load(snap: EngineSnapshot) -> WorkerLoad:
    """The load a router weighs: queued prefill work and running decodes."""
    return WorkerLoad(
        running=snap.num_running,
        waiting=snap.num_waiting,
        free_blocks=snap.kv_free_blocks,
        total_blocks=snap.kv_total_blocks,
        queued_prefill_tokens=snap.pending_prefill_tokens,
        waiting_pinned_blocks=snap.kv_waiting_pinned_blocks,
        admits_cached_first=int(snap.admits_cached_first),
        decode_tokens=snap.decoding_seqs,
        host_blocks=snap.host_total_blocks,
        lora_ids=snap.lora_ids,
        lora_loaded=snap.lora_loaded,
        lora_owners=snap.lora_owners,
    )


def worker_status(
    worker_id: str, snap: EngineSnapshot, *, epoch: int | None, index_healthy: bool
) -> WorkerStatus:
    """A worker's answer to a status call, from one snapshot of its engine."""
    return WorkerStatus(
        worker_id=worker_id,
        epoch=epoch,
        running=snap.num_running,
        waiting=snap.num_waiting,
        free_blocks=snap.kv_free_blocks,
        total_blocks=snap.kv_total_blocks,
        queued_prefill_tokens=snap.pending_prefill_tokens,
        prefix_hit_rate=snap.prefix_hit_rate,
        index_healthy=index_healthy,
        waiting_pinned_blocks=snap.kv_waiting_pinned_blocks,
        tenant_quota_evictions=snap.tenant_quota_evictions,
        host_total_blocks=snap.host_total_blocks,
        host_cached_blocks=snap.host_cached_blocks,
        host_hit_tokens=snap.host_hit_tokens,
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
