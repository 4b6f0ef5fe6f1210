"""The engine's figures: one snapshot of its state between steps (the one source of the
worker's load, status and gauges) and its metrics (the snapshot with latency percentiles)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvstore.blocks.protocol import TierFigures
from kvstore.blocks.tiers import Tier
from worker.engine.metrics import EngineMetrics, EngineSnapshot, LatencySummary, MetricsRecorder

if TYPE_CHECKING:
    from worker.engine.config import EngineConfig
    from worker.engine.executor import ModelExecutor
    from worker.engine.scheduler import Scheduler
    from worker.kv import KVCacheManager


class EngineFigures:
    """Mixin of :class:`~worker.engine.engine.Engine`, which owns the state named below
    (this module only reads it)."""

    config: EngineConfig
    executor: ModelExecutor
    kv: KVCacheManager
    scheduler: Scheduler
    stats: MetricsRecorder
    loras: dict[str, str]  # registered LoRA adapter name -> stable adapter id
    lora_tenants: dict[str, tuple[str, ...]]  # adapter name -> the tenants it is for

    def snapshot(self, *, pins_max_age_s: float = 0.0) -> EngineSnapshot:
        """The engine's figures at this moment (call between steps, in the engine's thread or
        under the front's lock): the one source of the worker's load, status and gauges.
        ``pins_max_age_s``: ``waiting_pinned_blocks`` may be a count that old
        (:meth:`WaitingQueue.pinned_blocks`; O(waiting prompt blocks) to recount), for a
        caller after every step."""
        kv = self.kv.stats()
        s = self.stats
        sched = self.scheduler
        loaded = set(self.executor.loaded_loras()) if self.loras else set()
        return EngineSnapshot(
            running=len(sched.running),
            waiting=len(sched.waiting),
            queued_prefill_tokens=sched.pending_prefill_tokens(),
            decode_tokens=sched.num_decoding_seqs(),
            kv_usage=kv.usage,
            kv_used_blocks=kv.used_blocks,
            free_blocks=kv.free_blocks,
            total_blocks=kv.num_blocks,
            prefix_hit_rate=kv.prefix_hit_rate,
            tenant_quota_evictions=kv.tenant_quota_evictions,
            num_preemptions=s.num_preemptions,
            num_swap_preemptions=s.num_swap_preemptions,
            recomputed_tokens=s.recomputed_tokens,
            waiting_pinned_blocks=sched.waiting.pinned_blocks(pins_max_age_s),
            admits_cached_first=self.config.cache_aware_admission,
            tiers={
                Tier.HOST: TierFigures(
                    kv.host_blocks,
                    kv.host_cached_blocks,
                    kv.host_hit_tokens,
                    kv.host_loaded_blocks,
                    kv.host_stored_blocks,
                )
            }
            if kv.host_blocks
            else {},
            num_partial_prefills=s.num_partial_prefills,
            num_steps=s.num_steps,
            computed_tokens=s.computed_tokens,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            num_finished=s.num_finished,
            lora_ids=tuple(sorted(self.loras.values())),
            lora_loaded=tuple(sorted(i for n, i in self.loras.items() if n in loaded)),
            lora_owners=tuple(
                sorted(f"{self.loras[n]}={t}" for n, ts in self.lora_tenants.items() for t in ts)
            ),
            stage_seconds=s.stages.snapshot(),
        )

    def metrics(self) -> EngineMetrics:
        """A snapshot plus TTFT / inter-token latency percentiles."""
        snap = self.snapshot()
        fields = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
        s = self.stats
        return EngineMetrics(**fields, ttft=LatencySummary.of(s.ttft), itl=LatencySummary.of(s.itl))
