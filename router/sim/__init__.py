"""Trace-replay simulator: real router + real KV managers + a step-level time model."""

from router.sim.config import SimConfig, TimeModel
from router.sim.records import RequestRecord, SimRequest
from router.sim.replay import ReplayResult, replay
from router.sim.report import Summary, summarize, tier_hit_rates
from router.sim.worker import SimWorker

__all__ = [
    "ReplayResult",
    "RequestRecord",
    "SimConfig",
    "SimRequest",
    "SimWorker",
    "Summary",
    "TimeModel",
    "replay",
    "summarize",
    "tier_hit_rates",
]
