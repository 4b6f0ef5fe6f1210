"""``kvcluster demo`` (the README's main job): a cluster on embedded defaults, a few
requests that share a prefix, and where they went.

Starts a local Ray, a local ``redis-server`` and the default model (SmolLM2-135M-Instruct)
in this process; sends chat requests, one per system prompt first (cold), then the rest
(warm), showing each answer, the worker it was routed to and how many prompt tokens came
from that worker's prefix cache.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from cluster.client import KVClusterClient, chat
from cluster.config import ClusterConfig, redact_url
from cluster.launcher import Cluster

SYSTEM_PROMPTS = [
    "You are a helpful geography tutor for a secondary school class. Answer in one or two "
    "short sentences, name the country or the city the question is about, and stay factual.",
    "You are a friendly science teacher. Explain ideas simply, in one or two short sentences, "
    "with an everyday example where one helps, and never invent facts.",
]
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "What is the capital of Italy?",
    "What is gravity?",
    "Which river flows through London?",
    "Why do leaves change colour?",
    "What is the largest ocean?",
    "What is a cell?",
]


def demo_messages(i: int) -> list[dict[str, str]]:
    """Request i's chat: system prompt i % 2 (shared by half the requests), one question."""
    return chat(QUESTIONS[i % len(QUESTIONS)], SYSTEM_PROMPTS[i % 2])


def run_demo(cfg: ClusterConfig, num_requests: int = 8, max_tokens: int = 40) -> int:
    t0 = time.monotonic()
    with Cluster(cfg) as cluster:
        print(
            f"cluster up in {time.monotonic() - t0:.1f}s: {len(cluster.workers)} workers, "
            f"router at {cluster.endpoints[0]}, redis {redact_url(cluster.redis_url)}, "
            f"model {cluster.model_id}"
        )
        print(f"dashboard: {cluster.ray_session.dashboard_url()} (token in ~/.ray/auth_token)\n")
        rows = []
        with KVClusterClient(cluster.endpoints[0]) as client:

            def send(i: int) -> None:
                out = client.generate(
                    demo_messages(i), max_tokens=max_tokens, temperature=0.0, request_id=f"demo-{i}"
                )
                rows.append((i, out))

            with ThreadPoolExecutor(2) as pool:  # cold: one per system prompt, together
                list(pool.map(send, range(min(2, num_requests))))
            time.sleep(0.3)  # let the workers' KV events reach the index
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(send, range(2, num_requests)))
            status = client.status()
        rows.sort()
        print(f"{'request':<9}{'system':>7}{'worker':>11}{'prompt':>8}{'cached':>8}  question")
        for i, out in rows:
            print(
                f"demo-{i:<4}{i % 2:>7}{out.worker_id:>11}{out.prompt_tokens:>8}"
                f"{out.cached_tokens:>8}  {QUESTIONS[i % len(QUESTIONS)]}"
            )
            answer = " ".join(out.text.split())
            answer = answer if len(answer) <= 100 else answer[:97] + "..."
            print(f"{'':<43}-> {answer}")
        print(f"\n{'worker':<12}{'running':>8}{'kv usage':>10}{'hit rate':>10}")
        for w in status.workers:
            print(f"{w.worker_id:<12}{w.running:>8}{w.kv_usage:>10.2f}{w.prefix_hit_rate:>10.2f}")
        warm = [out for i, out in rows if i >= 2]
        hit = sum(o.cached_tokens for o in warm) / max(1, sum(o.prompt_tokens for o in warm))
        same = sum(o.worker_id == rows[i % 2][1].worker_id for i, o in rows if i >= 2)
        print(
            json.dumps(
                {
                    "demo": {
                        "requests": len(rows),
                        "warm_prefix_hit_rate": round(hit, 3),
                        "warm_routed_with_their_prefix": same,
                        "decisions": dict(status.decisions),
                    }
                }
            )
        )
    return 0
