"""The engine of one worker: requests in, tokens out, one ``step`` at a time.

A step: the scheduler picks chunks (decodes, prefill chunks, admissions) under the token
budget and the KV manager's blocks; the executor runs host-tier swaps, copy-on-write copies
and the model; the output processor turns logits into tokens and stop decisions (sampler,
stop rules, detokenizer, beam search) and the scheduler applies them
(``update_from_output``): appends the tokens, forks and frees blocks, finishes requests;
finished sequences give their blocks back at once. Whatever one request's processing raises
ends that request alone with an error; a failure outside any one request fails the running
requests and the engine goes on serving.

Between steps, :meth:`Engine.snapshot` is the one record of the engine's state (the source of
the worker's load, status and gauges); :meth:`Engine.metrics` adds latency percentiles.
``generate`` runs prompts to completion offline (``offline.py``).

The engine is single-threaded and knows nothing about Ray, Redis or gRPC; the engine loop
(``engine_loop.py``) runs it in its own thread, and the worker actor wraps that.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path

from kvstore.requests.errors import EngineOverloaded, InvalidRequest
from kvstore.requests.histograms import HistogramCounts
from kvstore.requests.outputs import GenerationResult, RequestOutput
from kvstore.requests.sampling_params import SamplingParams
from worker.engine.config import EngineConfig, check_tenants
from worker.engine.executor import ModelExecutor, RunnerExecutor
from worker.engine.forward_window import ForwardWindow
from worker.engine.intake import Prompt, bad_word_ids, new_request, prompt_token_ids
from worker.engine.metrics import EngineMetrics, EngineSnapshot, LatencySummary, MetricsRecorder
from worker.engine.offline import run_to_completion
from worker.engine.outcome import RequestOutcome
from worker.engine.policy import get_policy
from worker.engine.prefill_rate import PrefillRate
from worker.engine.processor import OutputProcessor
from worker.engine.request import Request, Sequence
from worker.engine.sched_output import SchedulerOutput
from worker.engine.scheduler import Scheduler
from worker.engine.speculator import Speculator
from worker.engine.structured import GrammarCompiler, install_ready
from worker.engine.tier_copies import disk_tier_specs, run_tier_copies
from worker.engine.validate import validate_request
from worker.kv import BlockKey, HashContext, KVCacheManager, KVEvent
from worker.model.reasoning_markers import ReasoningMarkers
from worker.model.thread_count import configure_threads, current_threads

log = logging.getLogger(__name__)


class Engine:
    """Continuous-batching engine over one model executor and one KV block pool: admits
    requests, runs ``step`` (containing one request's failure within it), and reports its
    state (``snapshot``, ``metrics``)."""

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
        self.prefill_rate = PrefillRate()  # recomputing priced against lower-tier reads
        lower = disk_tier_specs(config, executor, model_id)
        self.kv = KVCacheManager(
            executor.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            tenant_quota_blocks=int(quota * executor.num_blocks) if quota < 1.0 else None,
            host_num_blocks=executor.num_host_blocks,
            lower_tiers=lower,
            recompute_seconds=self.prefill_rate.seconds_for if lower else None,
            block_sample_stride=config.kv_block_sample_stride if config.log_stats else 0,
        )
        spec = config.speculative
        self.speculator = Speculator(spec) if spec.enabled else None
        self.scheduler = Scheduler(config, self.kv, get_policy(config.policy), self.speculator)
        self.requests: dict[str, Request] = {}  # live requests by id
        self.stats = MetricsRecorder(config.log_stats)
        # the snapshot's histograms: (phases, blocks, both merged), see _histograms
        self._last_histograms: tuple[dict, dict, dict[str, HistogramCounts]] | None = None
        self._pending: list[RequestOutput] = []  # outputs of aborts, delivered by the next step
        self._arrivals = itertools.count()
        self.loras: dict[str, str] = {}  # registered LoRA adapter name -> stable adapter id
        self.window: ForwardWindow | None = None  # set by a front that lends the forward
        # adapter name -> the tenants it is registered for (absent: every tenant); the
        # routers enforce it, from the owners this engine reports
        self.lora_tenants: dict[str, tuple[str, ...]] = {}
        for name, path in config.lora_adapters.items():
            self.add_lora(name, path, config.lora_tenants.get(name))
        # a reasoning model's <think> / </think>: grammars start after the reasoning (None:
        # no such tokens, reasoning off, or a tokenizer stub that cannot say)
        self.reasoning: ReasoningMarkers | None = None
        tok = self.tokenizer
        if config.reasoning == "auto" and all(
            hasattr(tok, name) for name in ("token_to_id", "special_ids")
        ):
            self.reasoning = ReasoningMarkers.of(tok)
        self.processor = OutputProcessor(
            tokenizer=self.tokenizer,
            eos_ids=self.eos_ids,
            stats=self.stats,
            seed=config.seed,
            spec_verified=self.speculator.verified if self.speculator is not None else None,
            reasoning=self.reasoning,
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

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter added at run time; False if none is registered as ``name``.
        Its requests (waiting, running, compiling a grammar, preempted) end now with an error
        naming it, their blocks freed; their outputs come with the next ``step``. Its device
        slot is freed and the name may be registered again. Raises ``LoraError`` for an
        adapter of the engine config (every worker of the cluster serves those)."""
        from worker.model.lora import LoraError

        if name in self.config.lora_adapters:
            raise LoraError(
                f"adapter {name!r} is registered by the cluster config "
                "(workers.engine.lora_adapters) and cannot be unloaded; remove it there"
            )
        if name not in self.loras:
            return False
        error = f"adapter {name!r} was unloaded"
        for req in [r for r in self.requests.values() if r.params.lora == name]:
            self.scheduler.abort(req, error)
            self._pending.append(self.processor.output(req))
        self._reap()
        del self.loras[name]
        self.lora_tenants.pop(name, None)
        self.executor.remove_lora(name)
        return True

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
        continued: int = 0,
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequest / EngineOverloaded.

        ``prompt_keys``: ``block_keys(prompt, block_size, hash_context(params))`` if the caller
        has them (the worker hashes outside the engine lock, once for the scheduler and the
        router's parity check). ``continued``: the prompt ends with this many tokens of the
        request's own earlier output (a stream moved from another worker)."""
        params = params or SamplingParams()
        rid = request_id if request_id is not None else uuid.uuid4().hex
        prompt_ids = self.check_request(prompt, params)
        return self.add_checked(rid, prompt_ids, params, prompt_keys, continued)

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
        continued: int = 0,
    ) -> str:
        """Queue a request that passed :meth:`check_request` (between steps); raises
        InvalidRequest for a duplicate id or a bad ``continued``, EngineOverloaded for a full
        waiting queue."""
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
            continued=continued,
            bad_words=bad_word_ids(params.bad_words, self.tokenizer) if params.bad_words else (),
        )
        if params.structured is not None:
            assert self.grammars is not None
            req.grammar = self.grammars.submit(params.structured)
            req.awaiting_grammar = True
            if self.reasoning is not None:
                self._await_reasoning(req, continued)
            self._compiling.append(req)
            self._num_constrained += 1
        self.requests[rid] = req
        if self.speculator is not None:
            self.speculator.start(req)
        self.scheduler.add(req, prompt_keys)
        return rid

    def _await_reasoning(self, req: Request, continued: int) -> None:
        """Where ``req``'s grammar starts on a reasoning model (``structured.py``), read once
        from its prompt."""
        assert self.reasoning is not None
        state = self.reasoning.prompt_state(req.prompt_ids)
        if state == "none" and continued:
            # its output so far (the prompt's end) opened no reasoning: it answers already
            state = "closed"
        req.reasoning = state
        if state == "none":
            req.may_open_reasoning = True
            self.processor.openers += 1

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

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling + model step; return the news of every request that changed.

        Never raises for one request's sake: a request whose processing fails ends with an
        error (see ``OutputProcessor.fail``); an error outside any one request (the scheduler,
        the model) fails the running requests and the engine goes on serving. Only an error
        while failing them propagates (the engine's state cannot be trusted then)."""
        outputs, self._pending = self._pending, []
        try:
            return self._step(outputs)
        except Exception as exc:  # noqa: BLE001 - the engine must survive a failed step
            log.exception("engine step failed; aborting the running requests")
            return outputs + self._fail_running(f"engine step failed: {type(exc).__name__}: {exc}")

    def _install_grammars(self) -> None:
        """Compiles that ended: their requests may be admitted, or fail with the message."""
        self._compiling, failed = install_ready(self._compiling)
        for req, error in failed:
            self.scheduler.abort(req, error)
            self._pending.append(self.processor.output(req))
        self._reap()

    def idle_on_grammars(self) -> bool:
        """Nothing can run until a grammar compile ends (the engine loop sleeps until one does)."""
        return (
            bool(self._compiling)
            and not self._pending
            and not self.scheduler.running
            and all(r.awaiting_grammar for r in self.scheduler.waiting)
        )

    def wait_on_grammars(self, timeout: float) -> None:
        """Sleep until a grammar compile ends or ``timeout`` seconds pass (offline use)."""
        assert self.grammars is not None
        self.grammars.wait_any([r.grammar for r in self._compiling], timeout)  # type: ignore[misc]

    def _step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self._compiling:
            self._install_grammars()
            outputs += self._pending
            self._pending = []
        timer = self.stats.stages
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        self.stats.num_swap_preemptions += len(sched.swapped)
        self.stats.recomputed_tokens += sched.recomputed_tokens
        self.stats.num_partial_prefills += sched.num_partial_prefills
        changed: dict[str, Request] = {}
        t1 = time.perf_counter()
        timer.schedule += t1 - t0
        sampled_before = timer.sample
        if sched.chunks or sched.transfers:
            prepared_before = self.executor.prepare_seconds
            try:
                if sched.transfers:  # even without chunks: a host block is promised its data
                    run_tier_copies(self.executor, self.kv.tiers, sched.transfers)
                logits = None
                if sched.chunks:
                    if sched.blocks_to_copy:
                        self.executor.copy_blocks(sched.blocks_to_copy)
                    if self._num_constrained:  # their masks fill while the model runs
                        self.processor.start_masks(sched, self.executor.vocab_size)
                    if self.window is None:
                        logits = self.executor.execute(sched.chunks)
                    else:  # cached blocks may be exported meanwhile (window.py)
                        with self.window.open():
                            logits = self.executor.execute(sched.chunks)
            except Exception as exc:  # noqa: BLE001 - the engine must survive a failed step
                log.exception("model step failed; aborting running requests")
                return outputs + self._fail_running(f"model step failed: {exc!r}")
            prepared = self.executor.prepare_seconds - prepared_before
            t2 = time.perf_counter()
            timer.prepare += prepared
            timer.forward += t2 - t1 - prepared
            model_s, t1 = t2 - t1, t2
            if logits is not None:
                self.prefill_rate.observe(sched.num_prefill_tokens, model_s)
                timer.steps += 1
                self.stats.num_steps += 1
                self.stats.computed_tokens += sched.num_batched_tokens
                self.processor.masks.wait()  # (forks copy matchers)
                forks = self._fork_samples(sched, changed)
                generated = self.stats.generation_tokens
                for out in self.processor.process(sched, logits, forks):
                    changed[out.req.request_id] = out.req
                    self._apply(out)
                if self.speculator is not None and not sched.num_prefill_tokens:
                    self.speculator.end_step(
                        sched.num_draft_tokens > 0,
                        self.stats.generation_tokens - generated,
                        time.perf_counter() - t0,
                    )
        for req in sched.doomed:
            if not req.finished:
                changed[req.request_id] = req
                self._guarded(req, lambda r=req: self._apply(self.processor.capacity(r)))
        self._reap()
        t2 = time.perf_counter()
        timer.process += t2 - t1 - (timer.sample - sampled_before)
        now = time.monotonic()
        for req in changed.values():
            outputs.append(self._output(req, now))
        timer.output += time.perf_counter() - t2
        return outputs

    def _fork_samples(
        self, sched: SchedulerOutput, changed: dict[str, Request]
    ) -> dict[int, list[Sequence]]:
        """n > 1: a prompt's first logits fork its other samples (parent seq_id -> them)."""
        forks: dict[int, list[Sequence]] = {}
        for chunk in sched.chunks:
            req = chunk.req
            if not chunk.wants_logits or req.forked or req.doomed or req.finished:
                continue
            changed[req.request_id] = req

            def fork(r: Request = req, seq: Sequence = chunk.seq) -> None:
                texts = [self.processor.new_text(r) for _ in range(1, r.params.n)]
                forks[seq.seq_id] = self.scheduler.fork_samples(r, seq, texts)

            self._guarded(req, fork)
        return forks

    def _apply(self, out: RequestOutcome) -> None:
        """Hand one request's outcome to the scheduler (or fail the request it broke)."""
        req = out.req
        if out.error is not None:
            self._fail(req, out.error)
        elif not req.finished:  # (one that failed earlier in this step has nothing to apply)
            try:
                self.scheduler.update_from_output(out)
            except Exception as exc:  # noqa: BLE001 - one request's bug must not stop the engine
                self._fail(req, exc)
            else:
                self.stats.generation_tokens += out.num_tokens

    def _guarded(self, req: Request, fn: Callable[[], object]) -> bool:
        """Run one request's piece of work; False (and the request failed) if it raised."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one request's bug must not stop the engine
            self._fail(req, exc)
            return False
        return True

    def _fail(self, req: Request, exc: BaseException) -> None:
        """Processing ``req`` raised: end it (and only it) with an error, blocks freed."""
        log.exception(
            "request %s failed inside the engine; it is aborted, the engine goes on",
            req.request_id,
            exc_info=exc,
        )
        if not req.finished:
            req.final_deltas.clear()
            error = f"internal error processing the request: {type(exc).__name__}: {exc}"
            self.scheduler.abort(req, error)
            self._reap()

    def _reap(self) -> None:
        """Forget the requests the scheduler finished; count them."""
        for req in self.scheduler.take_finished():
            self.processor.release(req)
            if self.speculator is not None:
                self.speculator.finish(req)
            self.requests.pop(req.request_id, None)
            self._num_constrained -= req.params.structured is not None
            self.stats.num_finished += 1
            self.stats.prompt_tokens += req.prompt_len

    def _output(self, req: Request, now: float) -> RequestOutput:
        try:
            return self.processor.output(req, now)
        except Exception as exc:  # noqa: BLE001 - fail this request, not the step
            self._fail(req, exc)
            error = req.error or f"{type(exc).__name__}: {exc}"
            return RequestOutput(req.request_id, [], True, req.usage(), error)

    def _fail_running(self, error: str) -> list[RequestOutput]:
        failed = []
        for req in list(self.scheduler.running):
            self.scheduler.abort(req, error)
            failed.append(self.processor.output(req))
        self._reap()
        # Blocks of the failed step were registered in the prefix cache but never written.
        self.kv.reset_prefix_cache()
        return failed

    # ---- snapshot and metrics ------------------------------------------------------------

    def snapshot(self, *, pins_max_age_s: float = 0.0) -> EngineSnapshot:
        """The engine's figures at this moment (call between steps, in the engine's thread or
        under the engine loop's lock): the one source of the worker's load, status and gauges.
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
            prefix_hit_tokens=kv.prefix_hit_tokens,
            kv_tiers=kv.tiers,
            histograms=self._histograms(s.phases.histograms(), kv.block_histograms),
            waiting_by_reason=sched.waiting_by_reason(),
            **self._spec_counters(),
        )

    def _histograms(
        self, phases: dict[str, HistogramCounts], blocks: dict[str, HistogramCounts]
    ) -> dict[str, HistogramCounts]:
        """Both sets in one dict, built again only when either changed (each is one dict
        while unchanged): the snapshot after every step pays an identity check."""
        last = self._last_histograms
        if last is None or last[0] is not phases or last[1] is not blocks:
            last = self._last_histograms = (phases, blocks, {**phases, **blocks})
        return last[2]

    def _spec_counters(self) -> dict:
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {
            "spec_decode_num_drafts": c.num_drafts,
            "spec_decode_num_draft_tokens": c.num_draft_tokens,
            "spec_decode_num_accepted_tokens": c.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": tuple(c.accepted_per_pos),
        }

    def metrics(self) -> EngineMetrics:
        """A snapshot plus TTFT / inter-token latency percentiles."""
        snap = self.snapshot()
        fields = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap)}
        s = self.stats
        return EngineMetrics(**fields, ttft=LatencySummary.of(s.ttft), itl=LatencySummary.of(s.itl))

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
