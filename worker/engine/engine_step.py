"""The engine's step, and the containment of one request's failure within it.

A step: the scheduler picks chunks (decodes, prefill chunks, admissions) under the token
budget and the KV manager's blocks; the executor runs host-tier swaps, copy-on-write copies
and the model; the output processor turns logits into tokens and stop decisions and the
scheduler applies them (``update_from_output``). Whatever one request's processing raises
ends that request alone with an error; a failure outside any one request fails the running
requests and the engine goes on serving.

:class:`EngineStep` is mixed into :class:`~worker.engine.engine.Engine`, which owns the
state named below (this module only reads and steps it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.blocks.outputs import RequestOutput
from worker.engine.outcome import RequestOutcome
from worker.engine.request import Request, Sequence
from worker.engine.sched_output import SchedulerOutput
from worker.engine.structured import install_ready

if TYPE_CHECKING:
    from worker.engine.executor import ModelExecutor
    from worker.engine.metrics import MetricsRecorder
    from worker.engine.processor import OutputProcessor
    from worker.engine.scheduler import Scheduler
    from worker.engine.structured import GrammarCompiler
    from worker.engine.window import ForwardWindow
    from worker.kv import KVCacheManager

log = logging.getLogger(__name__)


class EngineStep:
    """``step`` and the failure handling around it (state set up by ``Engine.__init__``)."""

    executor: ModelExecutor
    kv: KVCacheManager
    scheduler: Scheduler
    processor: OutputProcessor
    stats: MetricsRecorder
    requests: dict[str, Request]
    window: ForwardWindow | None
    grammars: GrammarCompiler | None
    _pending: list[RequestOutput]  # outputs of aborts, delivered by the next step
    _compiling: list[Request]  # requests whose grammar is being compiled
    _num_constrained: int  # live requests with a grammar

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
        """Nothing can run until a grammar compile ends (the front sleeps until one does)."""
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
                    self.executor.swap(sched.transfers)
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
            t1 = t2
            if logits is not None:
                timer.steps += 1
                self.stats.num_steps += 1
                self.stats.computed_tokens += sched.num_batched_tokens
                self.processor.masks.wait()  # (forks copy matchers)
                forks = self._fork_samples(sched, changed)
                for out in self.processor.process(sched, logits, forks):
                    changed[out.req.request_id] = out.req
                    self._apply(out)
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
