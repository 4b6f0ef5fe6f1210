"""A stream whose worker dies goes on on another worker, as a continuation: ServingCore over
an in-process WorkerDirectory whose "model" is a function of the tokens so far (greedy), so
an uninterrupted run's tokens are known exactly (no Ray, Redis or gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import pytest

from kvstore.index_types import WorkerLoad
from kvstore.requests.output_constraint import StructuredOutputs
from kvstore.requests.outputs import CompletionDelta, FinishReason, RequestOutput, Usage
from kvstore.requests.protocol import Admitted, WorkerRequest, WorkerStatus
from kvstore.requests.sampling_params import SamplingParams
from router.placement.config import RoutingConfig
from router.placement.router import Router
from router.serving.core import ModelLimits, ServingCore, StreamBroken
from router.serving.workers import WorkerDirectory, WorkerGone

IDLE = WorkerLoad(running=0, waiting=0, free_blocks=100, total_blocks=100, queued_prefill_tokens=0)
LIMITS = ModelLimits("m", vocab_size=1000, max_model_len=4096, max_prompt_tokens=4095)
PROMPT = [11, 12, 13, 14]


def next_token(tokens: list[int]) -> int:
    """The deterministic "model": each token a function of every token before it."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 31 + 7) % 997


class DyingWorkers(WorkerDirectory):
    """Workers w0..w{n-1} that generate :func:`next_token`, two tokens per output; the
    worker serving the ``i``-th stream dies once it streamed ``deaths[i]`` tokens."""

    def __init__(self, n: int, deaths: list[int]) -> None:
        self.workers = [f"w{i}" for i in range(n)]
        self.deaths = deaths
        self.dead: set[str] = set()
        self.requests: list[tuple[str, WorkerRequest]] = []
        self.aborted: list[str] = []

    async def candidates(self) -> Mapping[str, WorkerLoad]:
        return {w: IDLE for w in self.workers if w not in self.dead}

    async def stream(
        self, worker_id: str, request: WorkerRequest
    ) -> AsyncIterator[Admitted | RequestOutput]:
        self.requests.append((worker_id, request))
        dies_after = (
            self.deaths[len(self.requests) - 1] if len(self.requests) <= len(self.deaths) else None
        )
        yield Admitted(worker_id, 1, None)
        tokens = list(request.token_ids)
        p = request.params
        made = 0
        while made < p.max_tokens:
            await asyncio.sleep(0)
            if dies_after == made:
                self.dead.add(worker_id)
                raise WorkerGone(f"{worker_id} died")
            new = []
            for _ in range(min(2, p.max_tokens - made)):
                new.append(next_token(tokens))
                tokens.append(new[-1])
            made += len(new)
            done = made == p.max_tokens
            delta = CompletionDelta(
                0,
                "".join(f"<{t}>" for t in new),
                new,
                finish_reason=FinishReason.LENGTH if done else None,
                cumulative_logprob=-0.5 * made,
            )
            usage = Usage(len(request.token_ids), 3, made)
            yield RequestOutput(request.request_id, [delta], done, usage)

    async def abort(self, worker_id: str, request_id: str) -> None:
        self.aborted.append(worker_id)

    async def statuses(self) -> list[WorkerStatus]:
        return []


def uninterrupted(n: int) -> list[int]:
    tokens = list(PROMPT)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(PROMPT) :]


def run(
    directory: DyingWorkers, params: SamplingParams, limit: int = 3
) -> tuple[list[RequestOutput], ServingCore]:
    outs: list[RequestOutput] = []
    core_box: list[ServingCore] = []

    async def collect() -> None:
        core = ServingCore(
            Router(RoutingConfig(policy="round_robin"), block_size=16),
            directory,
            LIMITS,
            migration_limit=limit,
        )
        core_box.append(core)
        try:
            async for _, out in core.generate("label", list(PROMPT), params):
                outs.append(out)
        finally:
            core.close()

    try:
        asyncio.run(collect())
    except StreamBroken:
        outs.append(None)  # type: ignore[arg-type]
    return outs, core_box[0]


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for d in o.outputs for t in d.token_ids]


def test_a_stream_moves_on_with_no_gap_and_no_duplicate() -> None:
    directory = DyingWorkers(3, [4])
    outs, core = run(directory, SamplingParams(max_tokens=12, temperature=0.0))
    assert tokens_of(outs) == uninterrupted(12)
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == FinishReason.LENGTH
    # usage counts from the original prompt, every token the client got, the first cached
    assert last.usage == Usage(len(PROMPT), 3, 12)
    assert last.outputs[0].cumulative_logprob == pytest.approx(-6.0)
    assert {o.request_id for o in outs} == {"label"}
    assert core.migrations == {"worker_died": 1}
    # the continuation: prompt + the 4 tokens sent, 8 left to make
    (w_first, first), (w_next, cont) = directory.requests
    assert list(cont.token_ids) == PROMPT + uninterrupted(4)
    assert cont.params.max_tokens == 8
    assert (first.continued, cont.continued) == (0, 4)  # the worker counts them as output
    assert w_next != w_first


def test_it_moves_again_up_to_its_limit() -> None:
    directory = DyingWorkers(4, [2, 2, 2])
    outs, core = run(directory, SamplingParams(max_tokens=10, temperature=0.0), limit=3)
    assert tokens_of(outs) == uninterrupted(10)
    assert core.migrations == {"worker_died": 3}
    assert [r.params.max_tokens for _, r in directory.requests] == [10, 8, 6, 4]
    assert [r.continued for _, r in directory.requests] == [0, 2, 4, 6]

    directory = DyingWorkers(4, [2, 2, 2])
    outs, core = run(directory, SamplingParams(max_tokens=10, temperature=0.0), limit=2)
    assert outs[-1] is None  # broken once its moves are spent
    assert tokens_of(outs[:-1]) == uninterrupted(6)
    assert core.migrations == {"worker_died": 2} and core.broken == 1


def test_min_tokens_count_what_was_sent() -> None:
    directory = DyingWorkers(2, [4])
    run(directory, SamplingParams(max_tokens=12, min_tokens=6, temperature=0.0))
    assert [r.params.min_tokens for _, r in directory.requests] == [6, 2]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, n=2, temperature=1.0),
        SamplingParams(max_tokens=8, beam_width=2, temperature=0.0),
        SamplingParams(max_tokens=8, structured=StructuredOutputs("regex", "a+")),
    ],
    ids=["n", "beams", "structured"],
)
def test_requests_that_cannot_continue_break_as_before(params: SamplingParams) -> None:
    directory = DyingWorkers(2, [2, 2])
    outs, core = run(directory, params)
    assert outs[-1] is None and core.broken == 1 and not core.migrations
    assert len(directory.requests) == 1


def test_no_moves_with_a_zero_limit() -> None:
    directory = DyingWorkers(2, [2])
    outs, core = run(directory, SamplingParams(max_tokens=8, temperature=0.0), limit=0)
    assert outs[-1] is None and core.broken == 1


def test_moves_are_exported_by_reason() -> None:
    from router.serving.serving_metrics import ServingMetrics

    body = ServingMetrics("m").render([], {"migrations": {"worker_died": 2}}).decode()
    assert 'kvc_migrations_total{reason="worker_died"} 2.0' in body


def test_a_client_resumes_after_the_tokens_it_has() -> None:
    """A client whose router died sends the tokens it got (``continue_from``): the request
    continues after them, as a moved one does."""
    from kvstore.requests.errors import InvalidRequest

    async def resume(params: SamplingParams, sent: list[int]) -> tuple[list, DyingWorkers]:
        directory = DyingWorkers(2, [])
        core = ServingCore(
            Router(RoutingConfig(policy="round_robin"), block_size=16), directory, LIMITS
        )
        try:
            gen = core.generate("label", list(PROMPT), params, continue_from=sent)
            return [out async for _, out in gen], directory
        finally:
            core.close()

    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs, directory = asyncio.run(resume(params, uninterrupted(4)))
    assert tokens_of(outs) == uninterrupted(12)[4:]
    assert outs[-1].usage == Usage(len(PROMPT), 3, 12)
    ((_, request),) = directory.requests
    assert list(request.token_ids) == PROMPT + uninterrupted(4)
    assert (request.params.max_tokens, request.continued) == (8, 4)
    for bad, sent in (
        (SamplingParams(max_tokens=12, n=2, temperature=1.0), [1]),
        (params, uninterrupted(12)),
        (params, [5000]),
    ):
        with pytest.raises(InvalidRequest, match="continue_from"):
            asyncio.run(resume(bad, sent))
