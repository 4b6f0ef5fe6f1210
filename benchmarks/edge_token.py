"""The router's own CPU per streamed token at its edges, the generic path against the one the
edges take, in one run:
the SSE event of a plain stream chunk (the chunk object through ``json.dumps`` against the
pre-encoded parts of :class:`router.http_api.sse.PlainChunks`), the client's label put on
each output (``dataclasses.replace`` against :func:`relabelled`), and, for scale, the gRPC
message of one output (built and serialized; the same in both).

No sockets, no loop: what the Python side costs per token, best of ``--repeat`` rounds of
``--tokens`` each. The socket write itself, and the client, come on top (``serving_path``).

    .venv/bin/python -m benchmarks.edge_token            # a few seconds
    .venv/bin/python -m benchmarks.edge_token --smoke    # well under a second
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import replace

from benchmarks.common import emit_json, print_table
from kvstore.requests.outputs import CompletionDelta, RequestOutput, Usage, relabelled
from router.edge.convert import responses_from_output
from router.http_api.openai_request import parse_request
from router.http_api.responses import Shaper
from router.placement.config import RequestLimits

TEXTS = [" the", " quick", " brown", "é", ' "fox"', "\n"]


def old_sse(obj: dict) -> bytes:
    """The event as it was written before the pre-encoded path."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def per_token_us(fn: Callable[[int], object], tokens: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for i in range(tokens):
            fn(i)
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / tokens


def shaper(chat: bool) -> Shaper:
    body: dict = {"model": "m", "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    meta, _ = parse_request(body, chat=chat, tenant=None, limits=RequestLimits(), now=0)
    return Shaper(meta, 1, None)  # type: ignore[arg-type]  # (plain chunks decode nothing)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.repeat = 2_000, 2
    usage = Usage(128, 0, 5)
    deltas = [CompletionDelta(0, t, [7]) for t in TEXTS]
    outs = [RequestOutput("r", [d], False, usage) for d in deltas]
    k = len(TEXTS)
    rows = []
    head: dict = {}
    for chat in (False, True):
        s = shaper(chat)
        for i in range(k):  # the same bytes both ways, checked before timing
            assert s.event(0, deltas[i], False, usage) == old_sse(s.chunk(0, deltas[i], False))
        old = per_token_us(
            lambda i, s=s: old_sse(s.chunk(0, deltas[i % k], False)), args.tokens, args.repeat
        )
        new = per_token_us(
            lambda i, s=s: s.event(0, deltas[i % k], False), args.tokens, args.repeat
        )
        name = "chat" if chat else "completions"
        rows.append(
            {"edge": f"sse {name}", "old us/tok": old, "new us/tok": new, "old/new": old / new}
        )
        head[f"sse_{name}_us_old"], head[f"sse_{name}_us_new"] = round(old, 3), round(new, 3)
    old = per_token_us(lambda i: replace(outs[i % k], request_id="label"), args.tokens, args.repeat)
    new = per_token_us(lambda i: relabelled(outs[i % k], "label"), args.tokens, args.repeat)
    rows.append({"edge": "label", "old us/tok": old, "new us/tok": new, "old/new": old / new})
    head["label_us_old"], head["label_us_new"] = round(old, 3), round(new, 3)

    def grpc(i: int) -> None:
        for msg in responses_from_output(outs[i % k], worker_id="w0", stream_text=False):
            msg.SerializeToString()

    g = per_token_us(grpc, args.tokens, args.repeat)
    rows.append({"edge": "grpc message", "old us/tok": g, "new us/tok": g, "old/new": 1.0})
    head["grpc_message_us"] = round(g, 3)
    print_table(rows, f"router edge CPU per token (best of {args.repeat} x {args.tokens:,})")
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
