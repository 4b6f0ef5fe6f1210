"""What the router learns from its requests as they run, off the serving path's control
flow: a worker's pull report refines the transfer model and the pull's row of the
predicted-vs-realised table; a request's first output compares the prefix hit the worker
realised with the one this router predicted (a worker whose predictions keep missing is
asked to resync its index entries) and, on a worker that was idle, times its prefill."""

from __future__ import annotations

import asyncio
import logging

from kvstore.blocks.outputs import RequestOutput
from kvstore.blocks.protocol import PullReport
from router.placement.placement_types import Reason, RouteDecision
from router.placement.prediction import PredictionTracker
from router.placement.router import Router
from router.serving.sent_work import SentWork
from router.serving.workers import WorkerDirectory

log = logging.getLogger(__name__)


class Outcomes:
    """One router's learning from its requests' pull reports and first outputs (on the event
    loop; what changes the router's own state goes through its decide thread elsewhere)."""

    def __init__(
        self,
        router: Router,
        directory: WorkerDirectory,
        own: SentWork,
        predictions: PredictionTracker | None,
    ) -> None:
        self.router = router
        self.directory = directory
        self.own = own  # which requests were placed on an idle worker
        self.predictions = predictions  # None: predictions are not compared
        self._resyncs: set[asyncio.Task] = set()  # resync requests in flight

    def pull(self, decision: RouteDecision, report: PullReport) -> None:
        """A worker reported its pull: learn the two nodes, refine the transfer model from a
        pull that imported, count the pull in the predicted-vs-realised table."""
        hint = decision.pull
        router = self.router
        if report.node:
            router.nodes[decision.worker_id] = report.node
        if report.source_node:
            router.nodes[report.source_id] = report.source_node
        planner = router.planner
        if planner is not None and report.outcome == "ok" and report.tokens:
            planner.transfers.observe(
                report.source_node, report.node, report.tokens, report.seconds
            )
        if self.predictions is not None and hint is not None:
            self.predictions.observe_pull(
                decision.worker_id,
                hint.num_blocks * router.block_size,
                report.tokens,
                report.seconds,
                hint.priced_s,
                router.config.pull.slow_factor,
            )

    def prefill(
        self, request_id: str, first: RequestOutput, ttft_s: float, pulled: PullReport | None
    ) -> None:
        """A request placed on an idle worker: its time to first token, less its pull, was
        its prefill of the uncached tokens (the prefill-rate estimate the planner uses)."""
        planner = self.router.planner
        if planner is None or request_id not in self.own.idle_at_placement:
            return
        seconds = ttft_s - (pulled.seconds if pulled is not None else 0.0)
        planner.observe_prefill(first.usage.prompt_tokens - first.usage.cached_tokens, seconds)

    def first_output(
        self, decision: RouteDecision, first: RequestOutput, pulled: PullReport | None = None
    ) -> None:
        """The first output reports the prefix hit the worker realised: compare it with the
        hit this router predicted; a worker whose predictions keep missing resyncs. A pull
        that imported less than planned is the pull's miss (counted with the pull), not the
        index's: the index's prediction is what the worker held plus what it imported."""
        if self.predictions is None or not decision.keys or decision.reason == Reason.NO_INDEX:
            return  # nothing was predicted from the index
        predicted = decision.cached_tokens_expected
        if decision.pull is not None:
            planned = decision.pull.num_blocks * self.router.block_size
            predicted -= planned - (pulled.tokens if pulled is not None else 0)
        imported = pulled is not None and pulled.outcome == "ok" and pulled.tokens > 0
        verdict = self.predictions.observe(
            decision.worker_id, predicted, first.usage.cached_tokens, pulled=imported
        )
        if verdict is None:
            return
        log.warning(
            "worker %s's index entries look wrong; asking it to resync: %s",
            verdict.worker_id,
            verdict.reason,
        )
        task = asyncio.get_running_loop().create_task(
            self.directory.resync(verdict.worker_id, verdict.reason)
        )
        self._resyncs.add(task)
        task.add_done_callback(self._resyncs.discard)
