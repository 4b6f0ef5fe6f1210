"""The router's own CPU per request and per streamed token, over gRPC and HTTP, on a cluster
of one worker and one router (``Cluster``).

    python -m benchmarks.router_cost            # light model, 256 streams
    python -m benchmarks.router_cost --smoke    # tiny model, seconds

Per edge: ``--waves`` waves of ``--streams`` one-token requests (all of a wave at once: what a
request costs the router, its intake, placement, submit, reply and stream), then one wave of
``--max-tokens``-token requests; the router process's CPU time (every thread: the loop, the
decide thread, Ray's and gRPC's) per request of each, and per token the difference over the
extra tokens. Run it on two trees back to back (``PYTHONPATH=<tree>``) to compare them; the
machine's load is printed with the figures (CPU time grows on a contended machine too).
Table, one JSON line.
"""

from __future__ import annotations

import argparse
import os
import time

import ray

from benchmarks.common import emit_json, print_table
from benchmarks.serving_path import cluster_config, engine_config, make_prompts
from benchmarks.stream_clients import run_grpc, run_http
from cluster.launcher import Cluster
from worker.model.build_tiny import build_tiny_model


def router_cpu_s(cluster: Cluster) -> float:
    h = next(iter(cluster.routers.values()))
    return ray.get(h.__ray_call__.remote(lambda r: time.process_time()))


def wave(cluster: Cluster, api: str, model: str, prompts: list[list[int]], tokens: int) -> None:
    if api == "grpc":
        run = run_grpc(cluster.endpoints[0], prompts, tokens)
    else:
        run = run_http(cluster.http_endpoints[0], model, prompts, tokens)
    assert run.tokens == len(prompts) * tokens, (api, run.tokens)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="light")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--waves", type=int, default=4, help="waves of one-token requests")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.streams, args.prompt, args.max_tokens, args.waves = "tiny", 16, 32, 8, 2
    model_dir = build_tiny_model(None, "llama", args.model, 0)
    engine = engine_config(args.streams, args.prompt, args.max_tokens, 0)
    cfg = cluster_config(f"router-cost-{os.getpid()}", model_dir, 1, engine)
    rows, head = [], {"load": os.getloadavg()[0]}
    with Cluster(cfg) as cluster:
        r = next(iter(cluster.routers.values()))
        model = ray.get(r.__ray_call__.remote(lambda s: s.settings.model_id))
        head["router_loop"] = ray.get(r.loop_lag.remote())["loop"]
        vocab = ray.get(r.__ray_call__.remote(lambda s: s.core.limits.vocab_size))
        for api in ("grpc", "http"):  # warm-up: channels opened, code paths hot
            wave(cluster, api, model, make_prompts(8, args.prompt, vocab, 1), 4)
        for api in ("grpc", "http"):
            per_req = {}
            for tokens, waves in ((1, args.waves), (args.max_tokens, 1)):
                cpu0 = router_cpu_s(cluster)
                for w in range(waves):
                    prompts = make_prompts(args.streams, args.prompt, vocab, 100 * tokens + w)
                    wave(cluster, api, model, prompts, tokens)
                per_req[tokens] = 1e3 * (router_cpu_s(cluster) - cpu0) / (waves * args.streams)
            per_token = (per_req[args.max_tokens] - per_req[1]) / (args.max_tokens - 1)
            rows.append(
                {
                    "edge": api,
                    "ms/request (1 token)": per_req[1],
                    f"ms/request ({args.max_tokens} tokens)": per_req[args.max_tokens],
                    "ms/token": per_token,
                }
            )
            head[f"{api}_ms_per_request"] = round(per_req[1], 3)
            head[f"{api}_ms_per_token"] = round(per_token, 4)
    print_table(rows, f"router CPU, {args.model} model, {args.streams} streams at once")
    print(f"  load average at start: {head['load']:.2f}")
    emit_json(head)
    return head


if __name__ == "__main__":
    main()
