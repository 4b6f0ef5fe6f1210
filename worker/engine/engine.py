"""The engine of one worker: requests in, tokens out, one ``step`` at a time.

A step: the scheduler picks chunks (decodes, prefill chunks, admissions) under the token
budget and the KV manager's blocks; the executor runs copy-on-write copies and the model;
the sampler turns logits into tokens; stop rules and the detokenizer turn tokens into
streamed deltas; finished sequences give their blocks back at once.

The engine is single-threaded and knows nothing about Ray, Redis or gRPC; the streaming
front (``front.py``) runs it in a thread, and the worker actor wraps that.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from worker.engine.beam import BeamSearch
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer, OutputText
from worker.engine.errors import EngineOverloaded, InvalidRequest
from worker.engine.executor import ModelExecutor, RunnerExecutor
from worker.engine.metrics import EngineMetrics, LatencySummary, MetricsRecorder
from worker.engine.outputs import CompletionDelta, FinishReason, GenerationResult, RequestOutput
from worker.engine.policy import get_policy
from worker.engine.request import Request, RequestStatus, Sequence, sample_generator
from worker.engine.sampler import SampleSpec, sample
from worker.engine.sampling_params import SamplingParams
from worker.engine.sched_output import SchedulerOutput
from worker.engine.scheduler import Scheduler
from worker.engine.validate import validate_request
from worker.kv import HashContext, KVCacheManager, KVEvent

log = logging.getLogger(__name__)

Prompt = str | list[int]


class Engine:
    """Continuous-batching engine over one model executor and one KV block pool."""

    def __init__(self, executor: ModelExecutor, config: EngineConfig | None = None) -> None:
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
        self.executor = executor
        self.tokenizer = executor.tokenizer
        self.max_model_len = config.max_model_len or limit
        self.eos_ids = frozenset(executor.eos_token_ids)
        self.kv = KVCacheManager(
            executor.num_blocks, config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )  # fmt: skip
        self.scheduler = Scheduler(config, self.kv, get_policy(config.policy))
        self.requests: dict[str, Request] = {}  # live requests by id
        self.stats = MetricsRecorder()
        self._pending: list[RequestOutput] = []  # outputs of aborts, delivered by the next step
        self._arrivals = itertools.count()
        self._rng = torch.Generator().manual_seed(config.seed)  # for unseeded requests

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        """Load a Hugging Face model folder with the runner and build an engine on it."""
        config = config or EngineConfig()
        executor = RunnerExecutor.from_model_dir(
            model_dir,
            dtype=config.dtype,
            device=config.device,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_memory_bytes=config.kv_memory_bytes,
            attn_backend=config.attn_backend,
        )
        return cls(executor, config)

    # ---- requests ------------------------------------------------------------------------

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequest / EngineOverloaded."""
        params = params or SamplingParams()
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self.requests:
            raise InvalidRequest("request_id", rid, "must be unique among live requests")
        prompt_ids = self._tokenize(prompt)
        validate_request(
            prompt_ids, params, config=self.config, vocab_size=self.executor.vocab_size,
            max_model_len=self.max_model_len, num_blocks=self.kv.num_blocks,
            has_tokenizer=self.tokenizer is not None,
        )  # fmt: skip
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(len(self.scheduler.waiting), self.config.max_waiting)
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        ctx = HashContext(self.config.model_id, None, params.cache_salt)
        req = Request(rid, prompt_ids, params, next(self._arrivals), ctx, max_new)
        if params.use_beam_search:
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
            req.beam = BeamSearch(
                params.beam_width, params.length_penalty, params.early_stopping, max_new, stop_ids
            )
        seq = Sequence(0, list(prompt_ids), len(prompt_ids), self._text(req), None)
        seq.generator = sample_generator(params.seed, 0)
        req.seqs.append(seq)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("prompt", prompt[:32], "text prompts need a tokenizer")
            return list(self.tokenizer.encode(prompt))
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequest("prompt", type(prompt).__name__, "must be text or token ids")
        return list(prompt)

    def _text(self, req: Request) -> OutputText | None:
        if self.tokenizer is None or req.beam is not None:
            return None
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, p.skip_special_tokens)
        return OutputText(detok, p.stop, p.include_stop_str_in_output)

    def abort(self, request_id: str) -> bool:
        """Abort a request at any time; its final output comes with the next ``step``."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._abort(req, None)
        return True

    def _abort(self, req: Request, error: str | None) -> None:
        req.error = error
        for seq in req.seqs:
            seq.finish_reason = FinishReason.ABORT
        req.done_seqs.extend(req.seqs)
        req.seqs = []
        self._finish_request(req)
        self._pending.append(self._output(req))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling + model step; return the news of every request that changed."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        self.stats.num_partial_prefills += sched.num_partial_prefills
        changed: dict[str, Request] = {}
        if sched.chunks:
            try:
                if sched.blocks_to_copy:
                    self.executor.copy_blocks(sched.blocks_to_copy)
                logits = self.executor.execute(sched.chunks)
            except Exception as exc:  # noqa: BLE001 - the engine must survive a failed step
                log.exception("model step failed; aborting running requests")
                self._fail_running(f"model step failed: {exc!r}")
                return outputs + self._pending_take()
            self.stats.num_steps += 1
            self.stats.computed_tokens += sched.num_batched_tokens
            self._process(sched, logits, changed)
        for req in sched.doomed:
            if not req.finished:
                self._finish_capacity(req)
                changed[req.request_id] = req
        now = time.monotonic()
        for req in changed.values():
            outputs.append(self._output(req, now))
        return outputs

    def _pending_take(self) -> list[RequestOutput]:
        out, self._pending = self._pending, []
        return out

    def _process(
        self, sched: SchedulerOutput, logits: torch.Tensor, changed: dict[str, Request]
    ) -> None:
        jobs: list[tuple[Request, Sequence, int]] = []
        beams: dict[str, Request] = {}
        rows = itertools.count()
        for chunk in sched.chunks:
            if not chunk.wants_logits:
                continue
            row, req = next(rows), chunk.req
            if req.doomed or req.finished:
                continue
            if req.beam is not None:
                chunk.seq.pending_logits = logits[row].clone()
                beams[req.request_id] = req
            else:
                jobs.append((req, chunk.seq, row))
        self._sample(jobs, logits, changed)
        for req in beams.values():
            if all(s.pending_logits is not None for s in req.seqs):
                self._beam_step(req)
                changed[req.request_id] = req

    def _sample(
        self, jobs: list[tuple[Request, Sequence, int]], logits: torch.Tensor,
        changed: dict[str, Request],
    ) -> None:  # fmt: skip
        targets: list[tuple[Request, Sequence]] = []
        rows: list[int] = []
        specs: list[SampleSpec] = []
        for req, seq, row in jobs:
            group = [seq]
            if not req.forked:  # n > 1: the prompt is computed once, then forked
                group += self._fork_samples(req, seq)
                req.forked = True
            for s in group:
                targets.append((req, s))
                rows.append(row)
                specs.append(SampleSpec(req.params, s.generator, self._banned(req, s)))
        if not targets:
            return
        tokens, logprobs = sample(logits[rows], specs, self._rng)
        for (req, seq), tok, lp in zip(targets, tokens, logprobs, strict=True):
            self._append(req, seq, tok, lp)
            changed[req.request_id] = req

    def _fork_samples(self, req: Request, seq: Sequence) -> list[Sequence]:
        kids = []
        for i in range(1, req.params.n):
            child = seq.fork(i, sample_generator(req.params.seed, i), self._text(req))
            self.kv.fork(seq.seq_id, child.seq_id)
            kids.append(child)
        req.seqs.extend(kids)
        return kids

    def _banned(self, req: Request, seq: Sequence) -> tuple[int, ...]:
        p = req.params
        if seq.num_output >= p.min_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_ids)
        return (*eos, *p.stop_token_ids)

    def _append(self, req: Request, seq: Sequence, tok: int, lp) -> None:  # noqa: ANN001
        p = req.params
        seq.token_ids.append(tok)
        seq.new_tokens.append(tok)
        if lp is not None:
            seq.new_logprobs.append(lp)
            seq.cumulative_logprob += lp.logprob
        self.stats.generation_tokens += 1
        req.protected = False
        req.progressed = True
        check = seq.num_output >= p.min_tokens
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        if check and tok in p.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, tok
        elif check and not p.ignore_eos and tok in self.eos_ids:
            reason = FinishReason.STOP
        if seq.text is not None:
            matched = seq.text.add(tok, check_stops=check, show=reason is None)
            if matched is not None and reason is None:
                reason, stop_reason = FinishReason.STOP, matched
        if reason is None and seq.num_output >= req.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._finish_seq(req, seq, reason, stop_reason)

    def _finish_seq(
        self, req: Request, seq: Sequence, reason: FinishReason, stop_reason: str | int | None
    ) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.text is not None:
            seq.text.finish(flush=not isinstance(stop_reason, str))
        self.scheduler.free_seq(seq)
        req.seqs.remove(seq)
        req.done_seqs.append(seq)
        if not req.seqs:
            self._finish_request(req)

    def _finish_request(self, req: Request) -> None:
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        self.requests.pop(req.request_id, None)
        self.stats.num_finished += 1
        self.stats.prompt_tokens += req.prompt_len

    # ---- beam search ---------------------------------------------------------------------

    def _beam_step(self, req: Request) -> None:
        assert req.beam is not None
        seqs = req.seqs
        logprobs = torch.stack([s.pending_logits for s in seqs]).log_softmax(dim=-1)
        for i, s in enumerate(seqs):
            s.pending_logits = None
            banned = self._banned(req, s)
            if banned:
                logprobs[i, list(banned)] = float("-inf")
        nxt = req.beam.step(logprobs, [s.output_ids for s in seqs])
        self.stats.generation_tokens += len(nxt)
        req.protected = False
        req.progressed = True
        if req.beam.done:
            self._finish_beam(req)
            return
        children: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for rank, (parent, tok) in enumerate(nxt):
            children[parent].append((rank, tok))
        new: list[Sequence | None] = [None] * len(nxt)
        for parent, seq in enumerate(seqs):
            mine = children.get(parent)
            if not mine:
                self.scheduler.free_seq(seq)  # pruned beam: blocks back at once
                continue
            for rank, tok in mine[1:]:  # fork before the parent appends its own token
                child = seq.fork(rank, None, None)
                self.kv.fork(seq.seq_id, child.seq_id)
                child.token_ids.append(tok)
                new[rank] = child
            rank, tok = mine[0]
            seq.token_ids.append(tok)
            seq.index = rank
            new[rank] = seq
        req.seqs = [s for s in new if s is not None]

    def _finish_beam(self, req: Request) -> None:
        assert req.beam is not None
        for rank, hyp in enumerate(req.beam.results(req.params.n)):
            toks = hyp.token_ids
            shown = toks[:-1] if hyp.hit_stop else toks
            text = (
                self.tokenizer.decode(shown, skip_special_tokens=req.params.skip_special_tokens)
                if self.tokenizer is not None
                else ""
            )
            reason = FinishReason.STOP if hyp.hit_stop else FinishReason.LENGTH
            stop = toks[-1] if hyp.hit_stop and toks[-1] in req.params.stop_token_ids else None
            req.final_deltas.append(
                CompletionDelta(rank, text, list(toks), None, reason, stop, hyp.score)
            )
        for seq in list(req.seqs):
            self.scheduler.free_seq(seq)
        req.seqs.clear()
        self._finish_request(req)

    # ---- failures ------------------------------------------------------------------------

    def _finish_capacity(self, req: Request) -> None:
        """The request cannot fit the KV cache even alone: end it with ``length``."""
        if req.beam is not None:
            req.beam.give_up([s.output_ids for s in req.seqs])
            self._finish_beam(req)
            return
        for seq in list(req.seqs):
            self._finish_seq(req, seq, FinishReason.LENGTH, "kv_capacity")
        if not req.finished:
            self._finish_request(req)

    def _fail_running(self, error: str) -> None:
        for req in list(self.scheduler.running):
            self._abort(req, error)
        # Blocks of the failed step were registered in the prefix cache but never written.
        self.kv.reset_prefix_cache()

    # ---- outputs and metrics -------------------------------------------------------------

    def _output(self, req: Request, now: float | None = None) -> RequestOutput:
        seqs = sorted((*req.seqs, *req.done_seqs), key=lambda s: s.index)
        if req.final_deltas:  # beam search: results only at the end
            deltas = req.final_deltas
        else:
            deltas = [s.take_delta() for s in seqs if s.has_news]
        progressed, req.progressed = req.progressed, False
        if now is not None and progressed:
            if req.first_token_time is None:
                req.first_token_time = now
                self.stats.ttft.append(now - req.arrival_time)
            else:
                self.stats.itl.append(now - (req.last_token_time or now))
            req.last_token_time = now
        return RequestOutput(req.request_id, deltas, req.finished, req.usage(), req.error)

    def metrics(self) -> EngineMetrics:
        kv = self.kv.stats()
        s = self.stats
        return EngineMetrics(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=kv.usage,
            kv_used_blocks=kv.used_blocks,
            kv_total_blocks=kv.num_blocks,
            prefix_hit_rate=kv.prefix_hit_rate,
            num_preemptions=s.num_preemptions,
            num_partial_prefills=s.num_partial_prefills,
            num_steps=s.num_steps,
            computed_tokens=s.computed_tokens,
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            num_finished=s.num_finished,
            ttft=LatencySummary.of(s.ttft),
            itl=LatencySummary.of(s.itl),
        )

    def drain_kv_events(self) -> list[KVEvent]:
        """KV block events since the last call (for the worker to publish to the index)."""
        return self.kv.drain_events()

    # ---- offline use ---------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion (blocking); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        todo = deque(zip(prompts, plist, strict=True))
        results: dict[str, GenerationResult] = {}
        order: list[str] = []
        open_ids: set[str] = set()
        while todo or open_ids:
            while todo and len(self.scheduler.waiting) < self.config.max_waiting:
                prompt, p = todo.popleft()
                rid = self.add_request(prompt, p)
                order.append(rid)
                results[rid] = GenerationResult(rid, [])
                open_ids.add(rid)
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].add(out)
                    if out.finished:
                        open_ids.discard(out.request_id)
        return [results[rid] for rid in order]
