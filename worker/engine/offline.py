"""Driving an engine offline: run a batch of prompts to completion, in the caller's thread."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from kvstore.requests.outputs import GenerationResult
from kvstore.requests.sampling_params import SamplingParams
from worker.engine.intake import Prompt

if TYPE_CHECKING:
    from worker.engine.engine import Engine


def run_to_completion(
    engine: Engine,
    prompts: Prompt | Seq[Prompt],
    params: SamplingParams | Seq[SamplingParams] | None = None,
) -> list[GenerationResult]:
    """``Engine.generate``: step until every prompt finished; results in prompt order. Adds
    as many prompts as the waiting queue takes, and sleeps on grammar compiles when nothing
    else can run."""
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
        while todo and len(engine.scheduler.waiting) < engine.config.max_waiting:
            prompt, p = todo.popleft()
            rid = engine.add_request(prompt, p)
            order.append(rid)
            results[rid] = GenerationResult(rid, [])
            open_ids.add(rid)
        news = engine.step()
        if not news and engine.idle_on_grammars():
            engine.wait_on_grammars(0.1)
        for out in news:
            if out.request_id in results:
                results[out.request_id].add(out)
                if out.finished:
                    open_ids.discard(out.request_id)
    return [results[rid] for rid in order]
