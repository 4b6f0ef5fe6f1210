"""Driving one worker actor directly in the pull tests: a request through an output channel
of its own (as a router's, with no caller to watch)."""

from __future__ import annotations

from typing import Any

import ray

from kvstore.blocks.outputs import OUTPUT_SCHEMA, RequestOutput, unpack_output
from kvstore.blocks.protocol import Admitted, WorkerRequest
from worker.engine.streams import StreamEnd


def send(handle: Any, req: WorkerRequest) -> tuple[Any, Any]:
    """Open a channel for ``req`` alone and submit it: (its Admitted's ref, the channel's
    stream of batches)."""
    channel_id = f"test/{req.request_id}"
    batches = handle.outputs.options(num_returns="streaming").remote(
        channel_id, None, OUTPUT_SCHEMA
    )
    return handle.submit.remote(req, None, channel_id), batches


def receive(sent: tuple[Any, Any], timeout_s: float = 120) -> tuple[Admitted, list[RequestOutput]]:
    """The admission and every output of a request :func:`send` sent, to its finished one."""
    admitted_ref, batches = sent
    admitted = ray.get(admitted_ref, timeout=timeout_s)
    outs: list[RequestOutput] = []
    for ref in batches:
        for item in ray.get(ref, timeout=timeout_s):
            if isinstance(item, StreamEnd):
                raise item.error
            outs.append(unpack_output(item))
            if outs[-1].finished:
                return admitted, outs
    raise AssertionError(f"the channel of {admitted.worker_id} ended before the request")


def generate(handle: Any, req: WorkerRequest) -> tuple[Admitted, list[int], int]:
    """The admission, the generated token ids and the cached prompt tokens of ``req``."""
    admitted, outs = receive(send(handle, req))
    toks = [t for out in outs for d in out.outputs for t in d.token_ids]
    return admitted, toks, outs[-1].usage.cached_tokens
