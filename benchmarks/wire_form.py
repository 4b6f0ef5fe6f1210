"""Cost of the worker<->router wire form: per-request messages by field name vs by position.

Per-request messages (``SamplingParams``, ``WorkerRequest``, ``Admitted``) pickle by field
name (``kvstore.requests.wire.ByName``: only fields that differ from their defaults, rebuilt
through the constructor, so this side's validation runs again). The baseline, in the same
run, is the positional form a frozen slots dataclass pickles to by default (``__newobj__``
plus the list of every field's value), made by a pickler that reduces the same objects that
way. The per-step output batches (``pack_output`` tuples, the hot path) are positional in
both; their layout is checked once per channel (``check_schema``), and both are timed here.

Each figure: the best of ``--repeat`` rounds of ``--iters`` round trips (dumps + loads, and
pack + unpack for outputs), in microseconds per message.

    .venv/bin/python -m benchmarks.wire_form            # full size
    .venv/bin/python -m benchmarks.wire_form --smoke    # well under a second
"""

from __future__ import annotations

import argparse
import copyreg
import io
import pickle
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import emit_json, print_table
from kvstore.requests.outputs import (
    OUTPUT_SCHEMA,
    CompletionDelta,
    RequestOutput,
    TokenLogprob,
    Usage,
    pack_output,
    unpack_output,
)
from kvstore.requests.protocol import Admitted, WorkerRequest
from kvstore.requests.sampling_params import SamplingParams
from kvstore.requests.wire import ByName, check_schema


class PositionalPickler(pickle.Pickler):
    """Pickles ByName types as they pickled before: by position (the dataclass state)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, ByName):
            return copyreg.__newobj__, (type(obj),), obj.__getstate__()  # type: ignore[attr-defined]
        return NotImplemented


def positional_dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    PositionalPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def by_name_dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def best_us(fn: Callable[[], Any], iters: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e6


def messages() -> dict[str, Any]:
    params = SamplingParams(
        max_tokens=256, temperature=0.7, top_p=0.9, seed=7, stop=("\n\n",), logprobs=None
    )
    return {
        "SamplingParams": params,
        "WorkerRequest (1k tokens)": WorkerRequest("req-0001", list(range(1024)), params),
        "Admitted": Admitted("worker-0", 3, b"k" * 16),
    }


def step_batch(n: int, logprobs: int) -> list[RequestOutput]:
    """One step's outputs for ``n`` requests: one token each (with top-``logprobs``)."""

    def lp(t: int) -> list[TokenLogprob] | None:
        if not logprobs:
            return None
        return [TokenLogprob(t, -0.5, tuple((t + k, -1.0 - k) for k in range(logprobs)))]

    return [
        RequestOutput(
            f"req-{i:04d}",
            [CompletionDelta(0, " tok", [100 + i], lp(100 + i))],
            False,
            Usage(512, 256, 10 + i),
        )
        for i in range(n)
    ]


def run(iters: int, repeat: int, batch: int) -> tuple[list[dict], dict]:
    rows = []
    head: dict[str, float] = {}
    for name, msg in messages().items():
        pos, named = positional_dumps(msg), by_name_dumps(msg)
        assert pickle.loads(pos) == msg and pickle.loads(named) == msg
        t_pos = best_us(lambda m=msg: pickle.loads(positional_dumps(m)), iters, repeat)
        t_named = best_us(lambda m=msg: pickle.loads(by_name_dumps(m)), iters, repeat)
        rows.append(
            {
                "message": name,
                "positional_us": t_pos,
                "by_name_us": t_named,
                "by_name/positional": t_named / t_pos,
                "positional_bytes": len(pos),
                "by_name_bytes": len(named),
            }
        )
        key = name.split()[0]
        head[f"wire_{key}_by_name_us"] = round(t_named, 2)
        head[f"wire_{key}_ratio"] = round(t_named / t_pos, 3)
    for logprobs in (0, 5):
        outs = step_batch(batch, logprobs)

        def trip(outs: list[RequestOutput] = outs) -> list[RequestOutput]:
            data = pickle.dumps([pack_output(o) for o in outs], protocol=pickle.HIGHEST_PROTOCOL)
            return [unpack_output(p) for p in pickle.loads(data)]

        assert trip() == outs
        per_output = best_us(trip, max(1, iters // 10), repeat) / batch
        rows.append(
            {
                "message": f"step batch of {batch} (logprobs={logprobs}), per output",
                "positional_us": per_output,
                "by_name_us": per_output,  # the same code: the layout is checked per channel
                "by_name/positional": 1.0,
                "positional_bytes": len(pickle.dumps([pack_output(o) for o in outs])) // batch,
                "by_name_bytes": len(pickle.dumps([pack_output(o) for o in outs])) // batch,
            }
        )
        head[f"wire_step_output_lp{logprobs}_us"] = round(per_output, 3)
    check = best_us(lambda: check_schema("output channel", OUTPUT_SCHEMA, OUTPUT_SCHEMA), iters, 3)
    head["wire_schema_check_per_channel_us"] = round(check, 3)
    return rows, head


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="outputs per step batch")
    ap.add_argument("--smoke", action="store_true", help="tiny run (tests)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.iters, args.repeat, args.batch = 200, 2, 8
    rows, head = run(args.iters, args.repeat, args.batch)
    print_table(rows, "wire form: round trip per message (dumps + loads), microseconds")
    check = head["wire_schema_check_per_channel_us"]
    print(f"\noutput schema check, once per channel open: {check} us")
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
