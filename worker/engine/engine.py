"""The engine of one worker: requests in, tokens out, one ``step`` at a time.

A step (``engine_step.py``): the scheduler picks chunks (decodes, prefill chunks,
admissions) under the token budget and the KV manager's blocks; the executor runs
copy-on-write copies and the model; the output processor turns logits into tokens and stop
decisions (sampler, stop rules, detokenizer, beam search) and the scheduler applies them
(``update_from_output``): appends the tokens, forks and frees blocks, finishes requests;
finished sequences give their blocks back at once. ``generate`` runs prompts to completion
offline (``offline.py``).

The engine is single-threaded and knows nothing about Ray, Redis or gRPC; the streaming
front (``front.py``) runs it in a thread, and the worker actor wraps that.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence as Seq
from pathlib import Path

from kvstore.blocks.errors import EngineOverloaded, InvalidRequest
from kvstore.blocks.outputs import GenerationResult, RequestOutput
from kvstore.blocks.sampling_params import SamplingParams
from worker.engine.config import EngineConfig, check_tenants
from worker.engine.engine_step import EngineStep
from worker.engine.executor import ModelExecutor, RunnerExecutor
from worker.engine.figures import EngineFigures
from worker.engine.intake import Prompt, new_request, prompt_token_ids
from worker.engine.metrics import (
    MetricsRecorder,
)
from worker.engine.offline import run_to_completion
from worker.engine.policy import get_policy
from worker.engine.processor import OutputProcessor
from worker.engine.request import Request
from worker.engine.scheduler import Scheduler
from worker.engine.structured import GrammarCompiler
from worker.engine.validate import validate_request
from worker.engine.window import ForwardWindow
from worker.kv import BlockKey, HashContext, KVCacheManager, KVEvent
from worker.model.cpu_threads import configure_threads, current_threads


class Engine(EngineStep, EngineFigures):
    """Continuous-batching engine over one model executor and one KV block pool (its
    ``step`` and the failure handling around it: :class:`~worker.engine.engine_step.EngineStep`;
    its snapshot and metrics: :class:`~worker.engine.figures.EngineFigures`)."""

    def __init__(
        self, executor: ModelExecutor, config: EngineConfig | None = None, *, model_id: str = ""
    ) -> None:
        """``model_id``: the served model's id, folded into block 0's key (the cluster config's
        ``model.model_id``; routers and the index use the same)."""
        config = config or EngineConfig()
        if executor.block_size != config.block_size:
            raise ValueError(
                f"executor block_size={executor.block_size} != config block_size="
                f"{config.block_size}"
            )
        limit = executor.max_model_len
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {limit}")
        self.config = config
        self.model_id = model_id
        self.executor = executor
        # the model's intra-op threads; per OS thread: the engine loop applies it on its own
        self.cpu_threads = (
            configure_threads(config.cpu_threads) if config.cpu_threads else current_threads()
        )
        self.tokenizer = executor.tokenizer
        self.max_model_len = config.max_model_len or limit
        self.eos_ids = frozenset(executor.eos_token_ids)
        quota = config.tenant_cache_fraction
        self.kv = KVCacheManager(
            executor.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            tenant_quota_blocks=int(quota * executor.num_blocks) if quota < 1.0 else None,
            host_num_blocks=executor.num_host_blocks,
        )
        self.scheduler = Scheduler(config, self.kv, get_policy(config.policy))
        self.requests: dict[str, Request] = {}  # live requests by id
        self.stats = MetricsRecorder()
        self._pending: list[RequestOutput] = []  # outputs of aborts, delivered by the next step
        self._arrivals = itertools.count()
        self.loras: dict[str, str] = {}  # registered LoRA adapter name -> stable adapter id
        self.window: ForwardWindow | None = None  # set by a front that lends the forward
        # adapter name -> the tenants it is registered for (absent: every tenant); the
        # routers enforce it, from the owners this engine reports
        self.lora_tenants: dict[str, tuple[str, ...]] = {}
        for name, path in config.lora_adapters.items():
            self.add_lora(name, path, config.lora_tenants.get(name))
        self.processor = OutputProcessor(
            tokenizer=self.tokenizer, eos_ids=self.eos_ids, stats=self.stats, seed=config.seed
        )
        # structured outputs: grammars compile off this thread; None without a real tokenizer
        self.grammars: GrammarCompiler | None = None
        if hasattr(self.tokenizer, "backend_json"):
            self.grammars = GrammarCompiler(
                self.tokenizer.backend_json(),
                vocab_size=executor.vocab_size,
                eos_ids=sorted(self.eos_ids),
            )
        self._compiling: list[Request] = []  # requests whose grammar is being compiled
        self._num_constrained = 0  # live requests with a grammar

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, config: EngineConfig | None = None, *, model_id: str = ""
    ) -> Engine:
        """Load a Hugging Face model folder (or a .gguf file) and build an engine on it."""
        config = config or EngineConfig()
        executor = RunnerExecutor.from_model_dir(
            model_dir,
            dtype=config.dtype,
            device=config.device,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_memory_bytes=config.kv_memory_bytes,
            attn_backend=config.attn_backend,
            cuda_graph_max_batch=config.max_num_seqs if config.cuda_graphs else 0,
            host_kv_bytes=config.host_kv_bytes,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
        )
        return cls(executor, config, model_id=model_id)

    def add_lora(self, name: str, path: str, tenants: Seq[str] | None = None) -> str:
        """Register a PEFT adapter folder under ``name`` (at start or at run time); returns
        its stable id, the ``lora_id`` of its requests' block keys. ``tenants``: the only
        tenants that may see and use it (None: every tenant; registering again sets them
        anew). Raises ``LoraError`` (a ``ValueError``) for a folder this model cannot serve."""
        from worker.model.lora import LoraError

        if self.executor.max_loras < 1:
            raise LoraError(
                f"adapter {name!r}: this engine's executor ({type(self.executor).__name__}) "
                "has no LoRA slots"
            )
        owners = None if tenants is None else check_tenants(name, tenants)
        adapter_id = self.executor.add_lora(name, str(path))
        self.loras[name] = adapter_id
        if owners is None:
            self.lora_tenants.pop(name, None)
        else:
            self.lora_tenants[name] = owners
        return adapter_id

    # ---- requests ------------------------------------------------------------------------

    def hash_context(self, params: SamplingParams) -> HashContext:
        """What a request's block keys are salted with (model id, LoRA id, tenant salt); reads
        no scheduling state, so callers may use it without the engine's lock."""
        lora_id = None
        if params.lora is not None:
            lora_id = self.loras.get(params.lora)
            if lora_id is None:
                served = ", ".join(sorted(self.loras)) or "none"
                raise InvalidRequest("lora", params.lora, f"unknown adapter; served: {served}")
        return HashContext(self.model_id, lora_id, params.cache_salt)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt_keys: Seq[BlockKey] | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequest / EngineOverloaded.

        ``prompt_keys``: ``block_keys(prompt, block_size, hash_context(params))`` if the caller
        has them (the worker hashes outside the engine lock, once for the scheduler and the
        router's parity check)."""
        params = params or SamplingParams()
        rid = request_id if request_id is not None else uuid.uuid4().hex
        return self.add_checked(rid, self.check_request(prompt, params), params, prompt_keys)

    def check_request(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, checked against the engine's fixed facts (model limits,
        KV size, config); raises InvalidRequest. Reads no scheduling state, so any thread
        may call it while a step runs (the streaming front checks before it queues)."""
        prompt_ids = prompt_token_ids(prompt, self.tokenizer)
        validate_request(
            prompt_ids,
            params,
            config=self.config,
            vocab_size=self.executor.vocab_size,
            max_model_len=self.max_model_len,
            num_blocks=self.kv.num_blocks,
            has_tokenizer=self.tokenizer is not None,
            eos_ids=self.eos_ids,
        )
        self.hash_context(params)  # an unknown adapter is the caller's error, found here
        if params.structured is not None and self.grammars is None:
            raise InvalidRequest(
                params.structured.field,
                params.structured.kind,
                "structured outputs need the model's tokenizer; this engine has none",
            )
        return prompt_ids

    def add_checked(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_keys: Seq[BlockKey] | None = None,
    ) -> str:
        """Queue a request that passed :meth:`check_request` (between steps); raises
        InvalidRequest for a duplicate id, EngineOverloaded for a full waiting queue."""
        if rid in self.requests:
            raise InvalidRequest("request_id", rid, "must be unique among live requests")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(len(self.scheduler.waiting), self.config.max_waiting)
        req = new_request(
            rid,
            prompt_ids,
            params,
            arrival=next(self._arrivals),
            ctx=self.hash_context(params),
            max_model_len=self.max_model_len,
            eos_ids=self.eos_ids,
            new_text=self.processor.new_text,
        )
        if params.structured is not None:
            assert self.grammars is not None
            req.grammar = self.grammars.submit(params.structured)
            req.awaiting_grammar = True
            self._compiling.append(req)
            self._num_constrained += 1
        self.requests[rid] = req
        self.scheduler.add(req, prompt_keys)
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request at any time; its final output comes with the next ``step``."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.abort(req, None)
        self._reap()
        self._pending.append(self.processor.output(req))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ---- outputs -------------------------------------------------------------------------

    def drain_kv_events(self) -> list[KVEvent]:
        """KV block events since the last call (for the worker to publish to the index)."""
        t0 = time.perf_counter()
        events = self.kv.drain_events()
        self.stats.stages.kv_events += time.perf_counter() - t0
        return events

    # ---- offline use ---------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion (blocking); results in prompt order."""
        return run_to_completion(self, prompts, params)
