"""``kvcluster`` command line: up, down, status, generate, bench, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from cluster.config import ConfigError, load_config, redact_url


def _endpoint(args: argparse.Namespace) -> str:
    if args.target:
        return args.target
    from cluster.launcher import ClusterState

    return ClusterState.load(args.name).endpoint()


def ray_cli_hint(ray_address: str, *, embedded: bool) -> str:
    """How to point the Ray CLI at a ``kvcluster up`` head: it runs with token auth (Ray 2.60
    turns it on when ``~/.ray/auth_token`` exists), which the CLI only uses when told; an
    embedded head (one ``up`` started) also needs the CLI in Ray's single-node mode."""
    from cluster.local_ray import RAY_SINGLE_NODE_ENV

    local = f"{RAY_SINGLE_NODE_ENV}=0 " if embedded else ""
    return f"RAY_AUTH_MODE=token {local}ray status --address {ray_address}"


def cmd_up(args: argparse.Namespace) -> int:
    from cluster.launcher import Cluster

    cfg = load_config(args.config)
    if args.ray_address:
        cfg = cfg.model_copy(update={"ray_address": args.ray_address})
    cluster = Cluster(cfg, detached=True).up()
    path = cluster.state().save()
    st = cluster.state()
    print(f"kvcluster {cfg.name!r} is up")
    print(f"  gRPC endpoints : {', '.join(st.endpoints)}")
    if st.http_endpoints:
        print(f"  OpenAI API     : {', '.join(u + '/v1' for u in st.http_endpoints)}")
    if st.dashboard_url:
        print(
            f"  dashboard      : {st.dashboard_url} (Ray 2.60: token in ~/.ray/auth_token, "
            "or RAY_AUTH_MODE=disabled)"
        )
    else:
        print("  dashboard      : off (dashboard: false)")
    hint = ray_cli_hint(st.ray_address, embedded=st.ray_pid is not None)
    print(f"  ray            : {st.ray_address} (Ray CLI: {hint})")
    print(f"  prometheus     : {st.prometheus_url or 'none (prometheus.start, or not installed)'}")
    print(f"  redis          : {redact_url(st.redis_url)}")
    print(f"  model          : {st.model_dir or 'default (resolved on each node)'}")
    print(f"  state          : {path}")
    print(
        "try: kvcluster generate --chat 'What is the capital of France?'   |   "
        "kvcluster status   |   kvcluster down"
    )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from cluster.ray_session import down_detached

    st = down_detached(args.name)
    print(f"kvcluster {st.name!r} is down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from cluster.client import KVClusterClient

    target = _endpoint(args)
    with KVClusterClient(target, discover=False) as client:  # its answer lists the routers
        st = client.status()
        # the cluster's routers now (those of nodes that joined after `up` included, those
        # gone with their node not), as the router that answered was told; else the targets
        routers = [r.grpc_address for r in st.routers] or client.targets
    print("routers: " + "  ".join(f"{a} ({router_state(a)})" for a in routers))
    # pinned: cached blocks the worker's waiting requests will pin (not room for a pull)
    print(
        f"model {st.model_id}  policy {st.policy}  index {'up' if st.index_available else 'DOWN'}"
    )
    print(
        f"{'worker':<12}{'epoch':>16}{'alive':>7}{'run':>5}{'wait':>6}{'kv use':>8}{'hit rate':>10}"
        f"{'quota evict':>13}{'pinned':>8}{'load s':>8}"
    )
    for w in st.workers:
        alive = "stale" if w.stale else str(w.alive)  # stale: no answer or no heartbeat
        print(
            f"{w.worker_id:<12}{w.epoch:>16}{alive:>7}{w.running:>5}{w.waiting:>6}"
            f"{w.kv_usage:>8.2f}{w.prefix_hit_rate:>10.2f}{w.tenant_quota_evictions:>13}"
            f"{w.waiting_pinned_blocks:>8}"
            + (f"{w.model_load_s:>8.1f}" if w.HasField("model_load_s") else f"{'-':>8}")
        )
        if w.adapters:  # LoRA adapters; * = in a device slot now
            print("  adapters: " + ", ".join(a.name + "*" * a.loaded for a in w.adapters))
        if w.host_total_blocks:  # host-memory KV tier (engine host_kv_bytes)
            print(
                f"  host tier: {w.host_cached_blocks}/{w.host_total_blocks} blocks, "
                f"{w.host_hit_tokens} tokens loaded back; preemptions: "
                f"{w.swap_preemptions} swap, {w.recompute_preemptions} recompute"
            )
    # this router's predicted vs realised prefix hits per worker (router/placement/prediction.py)
    print(
        f"{'worker':<12}{'predicted':>11}{'realised':>10}{'placed':>8}{'misses':>8}"
        f"{'gap now':>9}{'resyncs':>9}{'pulled':>9}{'pulls':>7}{'missed':>8}{'slow':>6}"
        f"{'evicted':>9}"
    )
    for w in st.workers:
        # pulled: tokens imported from peers by pulls (routing.pull), missed: pulls that
        # imported less than priced, slow: pulls slower than priced, evicted: pulls whose
        # import landed but whose hit still fell short (evicted before the request ran)
        print(
            f"{w.worker_id:<12}{w.predicted_cached_tokens:>11}{w.realised_cached_tokens:>10}"
            f"{w.prediction_placements:>8}{w.prediction_misses:>8}"
            f"{w.recent_cache_gap_tokens:>9.1f}{w.index_resyncs:>9}"
            f"{w.pulled_tokens:>9}{w.pulls:>7}{w.pull_misses:>8}{w.pull_slow:>6}"
            f"{w.pull_evicted:>9}"
        )
    if st.index_circuit_open:
        print(f"index circuit OPEN: routing by load, {st.index_reads_skipped} reads skipped")
    if st.decisions:
        print("decisions: " + json.dumps(dict(st.decisions)))
    _print_prometheus(args)
    return 0


def _print_prometheus(args: argparse.Namespace) -> None:
    """The cluster's Prometheus URL, from the state file of ``up`` (none with ``--target``)."""
    from cluster.state import ClusterState

    if args.target:
        return
    url = ClusterState.load(args.name).prometheus_url
    print(f"prometheus {url}" if url else "prometheus: none started (prometheus.start)")


def router_state(address: str) -> str:
    """ "up" when the router at ``address`` answers a status call within 5 s, else the code."""
    from cluster.client import KVClusterClient

    with KVClusterClient(address, retries=0) as client:
        try:
            client.status(timeout=5.0)
        except grpc.RpcError as exc:
            return exc.code().name
    return "up"


def cmd_generate(args: argparse.Namespace) -> int:
    from cluster.client import Completion, KVClusterClient, accumulate, build_request, chat

    out = Completion()
    # the state file's routers are the cluster's: keep them current even if up started one
    with KVClusterClient(_endpoint(args), discover=None if args.target else True) as client:
        req = build_request(
            chat(args.prompt, args.system) if args.chat else args.prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            cache_salt=args.cache_salt,
            lora=args.lora,
        )
        for msg in client.stream(req, timeout=args.timeout):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
            accumulate(out, msg)
    print(
        f"\n[worker {out.worker_id}; prompt {out.prompt_tokens} tokens, "
        f"{out.cached_tokens} cached; {out.completion_tokens} generated; "
        f"finish {out.finish_reasons.get(0)}]"
    )
    return 0


CHECKOUT = Path(__file__).resolve().parents[1]


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``python -m benchmarks.cluster_bench`` with the remaining arguments: the load
    generator lives with the benchmarks (a layer above this package, never imported here)."""
    if not (CHECKOUT / "benchmarks" / "cluster_bench.py").is_file():
        raise ConfigError(
            f"kvcluster bench runs benchmarks/cluster_bench.py of a source checkout, and "
            f"{CHECKOUT} has none: install kvcluster from a checkout (pip install -e)"
        )
    path = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "benchmarks.cluster_bench", *args.rest]
    return subprocess.call(cmd, env={**os.environ, "PYTHONPATH": path})


def cmd_tokenizer(args: argparse.Namespace) -> int:
    """Write the served model's tokenizer as a Hugging Face folder (for clients that count
    tokens themselves: ``vllm bench serve --tokenizer``, aiperf, lm-eval)."""
    from cluster.settings import resolve_model
    from worker.model.default_model import resolve_default_model
    from worker.model.tokenizer import Tokenizer

    cfg = load_config(args.config)
    path, model_id = resolve_model(cfg)
    path = path or str(resolve_default_model(cfg.model.tiny_family))
    out = Tokenizer.from_dir(path).save(args.out)
    print(f"tokenizer of {model_id} written to {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from cluster.demo import run_demo

    return run_demo(load_config(args.config), num_requests=args.requests)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcluster", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, fn, help_: str) -> argparse.ArgumentParser:  # noqa: ANN001
        sp = sub.add_parser(name, help=help_)
        sp.set_defaults(fn=fn)
        sp.add_argument("--name", default="kvcluster", help="cluster name (state file)")
        return sp

    sp = add("up", cmd_up, "start a cluster (embedded defaults without --config)")
    sp.add_argument("--config", help="cluster YAML (see deploy/kvcluster.yaml)")
    sp.add_argument("--ray-address", help="join this Ray cluster (e.g. 'auto' after ray up)")
    add("down", cmd_down, "stop the cluster started by `up`")
    # every argument after `bench` (--help included) goes to benchmarks/cluster_bench.py
    bench = sub.add_parser(
        "bench",
        help="load generator: table, plot, JSON line (kvcluster bench --help)",
        add_help=False,
    )
    bench.set_defaults(fn=cmd_bench)
    for name, fn, help_ in (
        ("status", cmd_status, "workers, load, KV usage, hit rates"),
        ("generate", cmd_generate, "stream a completion"),
    ):
        sp = add(name, fn, help_)
        sp.add_argument(
            "--target",
            help="router host:port, or several comma-separated (calls take turns and fail "
            "over); default: every router of the state file",
        )
        if name == "generate":
            sp.add_argument("prompt")
            sp.add_argument(
                "--chat",
                action="store_true",
                help="send the prompt as a user message (the model's chat template)",
            )
            sp.add_argument("--system", help="with --chat: a system message before it")
            sp.add_argument("--max-tokens", type=int, default=32)
            sp.add_argument("--temperature", type=float, default=0.0)
            sp.add_argument("--cache-salt", default="")
            sp.add_argument("--lora", default="", help="LoRA adapter name (default: base model)")
            sp.add_argument("--timeout", type=float, default=120.0)
    sp = add("tokenizer", cmd_tokenizer, "write the served model's tokenizer (HF folder)")
    sp.add_argument("out", help="folder to write tokenizer.json and tokenizer_config.json to")
    sp.add_argument("--config", help="cluster YAML (default: the embedded defaults)")
    sp = add("demo", cmd_demo, "start a cluster in-process, send prefix-sharing requests, stop")
    sp.add_argument("--config", help="cluster YAML")
    sp.add_argument("--requests", type=int, default=8)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.cmd != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return exit_code("kvcluster", lambda: args.fn(args))


def exit_code(prog: str, run: Callable[[], int]) -> int:
    """``run()``'s exit code; a user's error is one line on stderr instead of a traceback:
    2 for a bad config or a missing state file, 1 for an RPC the cluster refused."""
    try:
        return run()
    except (ConfigError, FileNotFoundError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"{prog}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
