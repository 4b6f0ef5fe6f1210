"""Worker metrics exported through ``ray.util.metrics`` (Ray's Prometheus endpoint and
dashboard): TTFT and inter-token latency histograms, prefix-hit and prompt tokens, KV
usage and queue lengths. Measured at the actor: arrival is when the router's call reached
this worker. Outside Ray (plain-class tests) nothing is exported but the counters still run.
"""

from __future__ import annotations

import time

import ray

from worker.engine import Engine, RequestOutput

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


class WorkerTelemetry:
    def __init__(self, worker_id: str) -> None:
        self.tags = {"worker": worker_id}
        self._arrival: dict[str, float] = {}  # request id -> arrival (until first token)
        self._last: dict[str, float] = {}  # request id -> last token time
        self.ttft_count = 0
        self.itl_count = 0
        self._exported = ray.is_initialized()
        if self._exported:
            from ray.util import metrics as m

            keys = ("worker",)
            self.ttft = m.Histogram("kvc_ttft_seconds", "Time to first token at the worker.",
                                    boundaries=LATENCY_BUCKETS_S, tag_keys=keys)
            self.itl = m.Histogram("kvc_inter_token_seconds", "Time between tokens.",
                                   boundaries=LATENCY_BUCKETS_S, tag_keys=keys)
            self.kv_usage = m.Gauge("kvc_kv_usage", "Fraction of KV blocks in use.",
                                    tag_keys=keys)
            self.running = m.Gauge("kvc_running", "Running requests.", tag_keys=keys)
            self.waiting = m.Gauge("kvc_waiting", "Waiting requests.", tag_keys=keys)
            self.hit_rate = m.Gauge("kvc_prefix_hit_rate",
                                    "Prompt tokens served from the prefix cache / admitted.",
                                    tag_keys=keys)
            self.preemptions = m.Gauge("kvc_preemptions", "Preemptions so far.", tag_keys=keys)
            self.quota_evictions = m.Gauge(
                "kvc_tenant_quota_evictions",
                "Idle cached blocks evicted because their tenant was over its cache quota.",
                tag_keys=keys,
            )

    def arrived(self, request_id: str) -> None:
        self._arrival[request_id] = time.monotonic()

    def after_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        """Engine thread, after each step (engine lock held)."""
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            if any(d.token_ids for d in out.outputs):
                arrival = self._arrival.pop(rid, None)
                if arrival is not None:
                    self.ttft_count += 1
                    if self._exported:
                        self.ttft.observe(now - arrival, self.tags)
                elif rid in self._last:
                    self.itl_count += 1
                    if self._exported:
                        self.itl.observe(now - self._last[rid], self.tags)
                self._last[rid] = now
            if out.finished:
                self._arrival.pop(rid, None)
                self._last.pop(rid, None)
        if self._exported:
            sched, kv = engine.scheduler, engine.kv.stats()
            self.kv_usage.set(kv.usage, self.tags)
            self.running.set(len(sched.running), self.tags)
            self.waiting.set(len(sched.waiting), self.tags)
            self.hit_rate.set(kv.prefix_hit_rate, self.tags)
            self.preemptions.set(engine.stats.num_preemptions, self.tags)
            self.quota_evictions.set(kv.tenant_quota_evictions, self.tags)
