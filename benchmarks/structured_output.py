"""Structured outputs on the engine: does every output parse, and what does the grammar cost?

    python -m benchmarks.structured_output            # SmolLM2-135M-Instruct (the default)
    python -m benchmarks.structured_output --smoke    # tiny random model, a few schemas

1. **Validity**: each JSON schema of ``benchmarks/structured_schemas.py`` (60) goes to the
   model as a chat ("reply with JSON following this schema"), constrained by the schema,
   twice: whole (``Engine.generate``) and streamed (``EngineLoop``, the deltas joined as
   a client joins them). Reported: the share that parses and validates (``jsonschema``).
2. **Tools**: 50 chat requests with 2-4 tools each and ``tool_choice=required``: the tools go
   through the chat template, the grammar is the one the HTTP edge builds
   (``router/http_api/tools.py``), the output is parsed into calls as the edge parses it.
   Reported: the share with at least one call whose arguments validate against its tool.
3. **Cost**: ``--batch`` (32) requests decode ``--steps`` tokens together, unconstrained and
   constrained (a JSON array of at least 64 integers: every step masks, none ends early),
   in alternating rounds after a warm-up; reported: decode steps per second of each and
   their ratio (the target is >= 0.9), the engine thread's sampling + processing ms per
   step (where a mask not ready in time would show), the grammar compile time and the
   compile cache's hit rate.

Measured (2-core VM shared with other jobs; SmolLM2-135M-Instruct Q4_1 in float32, torch
threads 1): see README "Structured outputs and tools".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from benchmarks.common import emit_json, print_table
from benchmarks.structured_schemas import schemas, tool_requests
from kvstore.blocks.structured import StructuredOutputs
from router.http_api.tool_calls import parse_calls
from router.http_api.tools import tools_from_body
from worker.engine import Engine, EngineConfig, EngineLoop, SamplingParams
from worker.model.build_tiny import build_tiny_model
from worker.model.default_model import default_model_path

COST_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 64}


def _chat(engine: Engine, content: str, tools: list | None = None) -> list[int]:
    messages = [{"role": "user", "content": content}]
    return engine.tokenizer.encode_chat(messages, tools=tools)


def _valid_json(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def validity(engine: Engine, sset: list[dict], max_tokens: int) -> dict[str, Any]:
    prompts = [
        _chat(engine, "Reply with JSON following this schema: " + json.dumps(s)) for s in sset
    ]
    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0, structured=StructuredOutputs.json_schema(s)
        )
        for s in sset
    ]
    t0 = time.perf_counter()
    whole = [r.completions[0].text for r in engine.generate(prompts, params)]
    whole_s = time.perf_counter() - t0
    with EngineLoop(engine) as front:
        streams = [front.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        streamed = ["".join(d.text for out in st for d in out.outputs) for st in streams]
    ok_whole = [_valid_json(t, s) for t, s in zip(whole, sset, strict=True)]
    ok_stream = [_valid_json(t, s) for t, s in zip(streamed, sset, strict=True)]
    bad = [t for t, ok in zip(whole, ok_whole, strict=True) if not ok][:3]
    return {
        "schemas": len(sset),
        "valid_whole": sum(ok_whole) / len(sset),
        "valid_streamed": sum(ok_stream) / len(sset),
        "same_text": sum(a == b for a, b in zip(whole, streamed, strict=True)) / len(sset),
        "whole_s": whole_s,
        "examples_invalid": bad,
        "example": whole[0],
    }


def tool_validity(engine: Engine, count: int, max_tokens: int) -> dict[str, Any]:
    reqs = tool_requests(count)
    prompts, params, specs = [], [], []
    for question, tools in reqs:
        spec = tools_from_body({"tools": tools, "tool_choice": "required"}, None)
        assert spec is not None and spec.constraint is not None
        specs.append(spec)
        prompts.append(_chat(engine, question, tools))
        params.append(
            SamplingParams(max_tokens=max_tokens, temperature=0, structured=spec.constraint)
        )
    results = engine.generate(prompts, params)
    ok = 0
    for (_, tools), spec, res in zip(reqs, specs, results, strict=True):
        _, calls = parse_calls(res.completions[0].text, spec)
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        ok += bool(calls) and all(
            _valid_json(c["function"]["arguments"], by_name[c["function"]["name"]]) for c in calls
        )
    return {"requests": count, "valid_calls": ok / count, "example": results[0].completions[0].text}


def _decode_rate(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, float]:
    """(decode steps per second, ms per step in sampling + processing) over the steps in
    which every prompt decodes one token."""
    for p in prompts:
        engine.add_request(p, params)
    steps, spent, post = 0, 0.0, 0.0
    stages = engine.stats.stages
    while engine.has_unfinished_requests():
        before = engine.stats.computed_tokens
        after_model = stages.sample + stages.process
        t = time.perf_counter()
        engine.step()
        if engine.stats.computed_tokens - before == len(prompts) and not engine.scheduler.waiting:
            spent += time.perf_counter() - t
            post += stages.sample + stages.process - after_model
            steps += 1
    if not spent:
        return 0.0, 0.0
    return steps / spent, 1e3 * post / steps


def cost(engine: Engine, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    prompts = [_chat(engine, f"List numbers, case {i}.") for i in range(batch)]
    free = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    guided = SamplingParams(
        max_tokens=steps, temperature=0, structured=StructuredOutputs.json_schema(COST_SCHEMA)
    )
    rates: dict[str, list[float]] = {"free": [], "constrained": []}
    post: dict[str, list[float]] = {"free": [], "constrained": []}
    for params in (free, guided):  # warm-up (first-use costs), not counted
        _decode_rate(engine, prompts[:2], params)
    for _ in range(rounds):
        for name, params in (("free", free), ("constrained", guided)):
            rate, ms = _decode_rate(engine, prompts, params)
            rates[name].append(rate)
            post[name].append(ms)
    free_r, con_r = statistics.median(rates["free"]), statistics.median(rates["constrained"])
    return {
        "free_steps_s": free_r,
        "constrained_steps_s": con_r,
        "ratio": con_r / free_r,
        "free_post_ms": statistics.median(post["free"]),
        "constrained_post_ms": statistics.median(post["constrained"]),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny random model, a few schemas")
    parser.add_argument("--model", default="default", help="default (SmolLM2) or a path")
    parser.add_argument("--schemas", type=int, default=60)
    parser.add_argument("--tool-requests", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24, help="decode steps per cost round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = default)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.schemas, args.tool_requests, args.batch, args.steps, args.rounds = 6, 4, 4, 4, 1
        model: Path = build_tiny_model()
    else:
        model = default_model_path() if args.model == "default" else Path(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = EngineConfig(
        max_num_seqs=64, max_num_batched_tokens=2048, kv_memory_bytes=1 << 30, max_model_len=2048
    )
    engine = Engine.from_model_dir(model, cfg)
    t0 = time.perf_counter()
    v = validity(engine, schemas(args.schemas), args.max_tokens)
    t = tool_validity(engine, args.tool_requests, args.max_tokens)
    c = cost(engine, args.batch, args.steps, args.rounds)
    g = engine.grammars.stats()  # type: ignore[union-attr]
    print_table(
        [
            {"check": "schemas, whole", "n": v["schemas"], "valid": v["valid_whole"]},
            {"check": "schemas, streamed", "n": v["schemas"], "valid": v["valid_streamed"]},
            {"check": "tool_choice=required", "n": t["requests"], "valid": t["valid_calls"]},
        ],
        f"validity ({model.name})",
    )
    print_table(
        [
            {
                "batch": args.batch,
                "unconstrained steps/s": c["free_steps_s"],
                "constrained steps/s": c["constrained_steps_s"],
                "ratio": c["ratio"],
                "sample+process ms (free)": c["free_post_ms"],
                "sample+process ms (constrained)": c["constrained_post_ms"],
            },
        ],
        "decode step rate",
    )
    print_table(
        [
            {
                "compiles": g.compiles,
                "mean compile ms": 1e3 * g.compile_s / max(g.compiles, 1),
                "requests": g.requests,
                "cache hit rate": g.hit_rate,
                "failures": g.failures,
            }
        ],
        "grammar compiler",
    )
    print(f"\nexample output: {v['example']}\nexample tool call: {t['example']}")
    for bad in v["examples_invalid"]:
        print(f"invalid: {bad[:200]!r}")
    head = {
        "structured_schemas": v["schemas"],
        "structured_valid_whole": round(v["valid_whole"], 4),
        "structured_valid_streamed": round(v["valid_streamed"], 4),
        "structured_tool_required_valid": round(t["valid_calls"], 4),
        "structured_step_rate_ratio": round(c["ratio"], 4),
        "structured_free_steps_s": round(c["free_steps_s"], 3),
        "structured_constrained_steps_s": round(c["constrained_steps_s"], 3),
        "structured_post_ms_free": round(c["free_post_ms"], 2),
        "structured_post_ms_constrained": round(c["constrained_post_ms"], 2),
        "structured_compile_ms_mean": round(1e3 * g.compile_s / max(g.compiles, 1), 3),
        "structured_cache_hit_rate": round(g.hit_rate, 4),
        "structured_wall_s": round(time.perf_counter() - t0, 1),
    }
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
