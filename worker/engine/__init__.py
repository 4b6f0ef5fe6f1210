"""One worker's engine: requests, scheduler, sampler, stop handling, the step loop.

Knows nothing about Ray, Redis or gRPC. Offline use::

    engine = Engine.from_model_dir(model_dir, EngineConfig(num_blocks=512))
    results = engine.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

Streaming (thread-safe, asyncio-friendly): :class:`EngineLoop`.
"""

from kvstore.blocks.errors import EngineError, EngineOverloaded, EngineStopped, InvalidRequest
from kvstore.blocks.outputs import (
    Completion,
    CompletionDelta,
    FinishReason,
    GenerationResult,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from kvstore.blocks.sampling_params import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.engine_loop import EngineLoop
from worker.engine.executor import ModelExecutor, RunnerExecutor
from worker.engine.metrics import EngineMetrics, EngineSnapshot, LatencySummary
from worker.engine.policy import SchedulingPolicy, get_policy, policy_names, register_policy
from worker.engine.streams import OutputSink, RequestStream, StreamEnd

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
