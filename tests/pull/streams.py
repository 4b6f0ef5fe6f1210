"""Driving one worker actor directly in the pull tests: a request's whole stream."""

from __future__ import annotations

import ray

from kvstore.blocks.outputs import OUTPUT_SCHEMA
from kvstore.blocks.protocol import Admitted, WorkerRequest


def generate(handle, req: WorkerRequest) -> tuple[Admitted, list[int], int]:
    """The admission, the generated token ids and the cached prompt tokens of ``req``."""
    items = [
        ray.get(r, timeout=120)
        for r in handle.generate.options(num_returns="streaming").remote(req, None, OUTPUT_SCHEMA)
    ]
    toks = [t for out in items[1:] for d in out.outputs for t in d.token_ids]
    return items[0], toks, items[-1].usage.cached_tokens
