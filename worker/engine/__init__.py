"""One worker's engine: requests, scheduler, sampler, stop handling, the step loop.

Knows nothing about Ray, Redis or gRPC. Offline use::

    engine = Engine.from_model_dir(model_dir, EngineConfig(num_blocks=512))
    results = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

Streaming (thread-safe, asyncio-friendly): :class:`EngineLoop`.
"""

import importlib
from typing import TYPE_CHECKING, Any

from kvstore.requests.errors import EngineError, EngineOverloaded, EngineStopped, InvalidRequest
from kvstore.requests.outputs import (
    Completion,
    CompletionDelta,
    FinishReason,
    GenerationResult,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from kvstore.requests.sampling_params import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.metrics import EngineMetrics, EngineSnapshot, LatencySummary
from worker.engine.policy import SchedulingPolicy, get_policy, policy_names, register_policy
from worker.engine.streams import OutputSink, RequestStream, StreamEnd

if TYPE_CHECKING:
    from worker.engine.engine import Engine
    from worker.engine.engine_loop import EngineLoop
    from worker.engine.executor import ModelExecutor, RunnerExecutor

# the parts that import torch load on first use: a router unpickling the worker actor's
# class (to call a worker) imports this package and never runs an engine
_HEAVY = {
    "Engine": "worker.engine.engine",
    "EngineLoop": "worker.engine.engine_loop",
    "ModelExecutor": "worker.engine.executor",
    "RunnerExecutor": "worker.engine.executor",
}


def __getattr__(name: str) -> Any:
    if name in _HEAVY:
        return getattr(importlib.import_module(_HEAVY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Completion",
    "CompletionDelta",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineMetrics",
    "EngineSnapshot",
    "EngineOverloaded",
    "EngineStopped",
    "FinishReason",
    "GenerationResult",
    "InvalidRequest",
    "LatencySummary",
    "ModelExecutor",
    "OutputSink",
    "RequestOutput",
    "RequestStream",
    "RunnerExecutor",
    "SamplingParams",
    "SchedulingPolicy",
    "StreamEnd",
    "EngineLoop",
    "TokenLogprob",
    "Usage",
    "get_policy",
    "policy_names",
    "register_policy",
]
