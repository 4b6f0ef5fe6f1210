"""kvcluster's Grafana dashboards, declared once here and written as Grafana JSON into
``deploy/grafana/`` (``python -m cluster.dashboards``; a test checks the files are current).

Three dashboards: the cluster overview (traffic, latency, queue and decode time, SLO
attainment), KV cache and routing (usage, prefix hits, the cache funnel, predicted vs realised,
pulls, KV block residency, decisions), and nodes and workers (per-worker queues, waiting
reasons and blocks, request phases, preemptions, speculative decoding, the workers' own
latencies and the nodes' CPU and memory from Ray's export). Every query names metrics the code
defines: the routers' ``/metrics`` (``router/serving/serving_metrics.py``; with the histograms
the engines measure, which every router exports from the workers' statuses), what workers and
routers export through Ray (``worker/telemetry.py``, ``router/serving/metrics_exporter.py``,
named ``ray_<name>`` by Ray's exporter), Ray's node metrics and Prometheus's ``up``; a test
parses every query and fails on any other name.

Each dashboard takes its Prometheus from a ``datasource`` variable, so the same file imports
into any Grafana and into the Grafana Ray provisions (its dashboards folder).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "deploy" / "grafana"
WINDOW = "$__rate_interval"  # Grafana's rate window: at least four scrapes
FUNNEL_PROMPT = 'kvc_cache_funnel_tokens_total{stage="prompt"}'


@dataclass(frozen=True)
class Panel:
    """One time-series panel: its queries (PromQL, legend) and unit (Grafana's names)."""

    title: str
    queries: tuple[tuple[str, str], ...]
    unit: str = "short"
    description: str = ""
    width: int = 12  # of Grafana's 24 columns


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def rate(metric: str, by: str = "", window: str = WINDOW) -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}[{window}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    labels = ", ".join(["le", *([by] if by else [])])
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket[{WINDOW}])))"


def worker_quantile(q: float, histogram: str) -> str:
    """A quantile of a histogram the workers measure: every router exports every worker's
    counts (from its status), so each worker's bucket rates are taken once (``max``)."""
    per_worker = f"max by (worker, le) (rate({histogram}_bucket[{WINDOW}]))"
    return f"histogram_quantile({q}, sum by (le) ({per_worker}))"


def engine_panel(title: str, histogram: str, description: str) -> Panel:
    """p50 / p90 / p99 of a histogram measured in the engines (``worker_quantile``)."""
    return Panel(
        title,
        tuple((worker_quantile(q, histogram), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)),
        unit="s",
        description=description,
    )


def latency_panel(title: str, histogram: str, description: str) -> Panel:
    return Panel(
        title,
        tuple((quantile(q, histogram), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)),
        unit="s",
        description=description,
    )


OVERVIEW = Dashboard(
    "kvcluster-overview",
    "kvcluster / Cluster overview",
    "Traffic, latency and SLO attainment of the whole cluster (sums over routers).",
    (
        Panel(
            "Requests finished per second",
            ((rate("vllm:request_success_total", "finished_reason"), "{{finished_reason}}"),),
            unit="reqps",
        ),
        Panel(
            "Tokens per second",
            (
                (rate("vllm:prompt_tokens_total"), "prompt"),
                (rate("vllm:generation_tokens_total"), "generated"),
            ),
        ),
        latency_panel(
            "Time to first token",
            "vllm:time_to_first_token_seconds",
            "From a request's arrival at its router to its first token.",
        ),
        latency_panel(
            "Inter-token latency", "vllm:inter_token_latency_seconds", "Between output tokens."
        ),
        latency_panel(
            "Request latency", "vllm:e2e_request_latency_seconds", "Arrival to last token."
        ),
        engine_panel(
            "Queue time (in the engine)",
            "vllm:request_queue_time_seconds",
            "A request's arrival at its worker's engine to its first admission.",
        ),
        engine_panel(
            "Decode time (in the engine)",
            "vllm:request_decode_time_seconds",
            "First token to last token, at the worker.",
        ),
        Panel(
            "SLO attainment",
            (
                (
                    f"{rate('kvc_slo_met_total', 'slo')} / {rate('kvc_slo_observed_total', 'slo')}",
                    "{{slo}}",
                ),
            ),
            unit="percentunit",
            description="Share of requests within the TTFT bound and of tokens within the "
            "inter-token bound (router.slo).",
        ),
        Panel(
            "Requests running and waiting",
            (
                ("sum(vllm:num_requests_running)", "running"),
                ("sum(vllm:num_requests_waiting)", "waiting"),
            ),
        ),
        Panel(
            "Router requests by phase (where they wait)",
            (("sum by (phase) (kvc_router_requests)", "{{phase}}"),),
            description="routing; submitting (awaiting a worker's admission); first_token (in "
            "a worker's queue or prefill); streaming.",
        ),
        Panel(
            "Errors, retries and broken streams per second",
            (
                (f"{rate('kvc_request_errors_total', 'status')} or vector(0)", "{{status}}"),
                (rate("kvc_router_retries_total"), "retried"),
                (rate("kvc_router_broken_streams_total"), "broken"),
            ),
        ),
        Panel(
            "Routers and workers up",
            (
                ('sum(up{job="kvcluster-routers"})', "routers"),
                ("max by (worker) (kvc_worker_alive)", "{{worker}}"),
            ),
        ),
    ),
)

KV_ROUTING = Dashboard(
    "kvcluster-kv-routing",
    "kvcluster / KV cache and routing",
    "KV usage, prefix hits, the cache funnel, predicted vs realised hits, pulls, decisions.",
    (
        Panel(
            "KV cache usage",
            (("max by (worker) (vllm:kv_cache_usage_perc)", "{{worker}}"),),
            "percentunit",
        ),
        Panel(
            "Prefix cache hit rate",
            (
                (
                    f"{rate('vllm:prefix_cache_hits_total')} / "
                    f"{rate('vllm:prefix_cache_queries_total')}",
                    "cluster",
                ),
                ("max by (worker) (kvc_worker_prefix_hit_rate)", "{{worker}} (engine)"),
            ),
            "percentunit",
        ),
        Panel(
            "Cache funnel (share of prompt tokens)",
            (
                (
                    f"{rate('kvc_cache_funnel_tokens_total', 'stage')} / ignoring(stage) "
                    f"group_left {rate(FUNNEL_PROMPT)}",
                    "{{stage}}",
                ),
            ),
            "percentunit",
            "Prompt tokens: held by the index's best holder, best candidate, expected on the "
            "chosen worker, realised. A drop names its cause: holder not a candidate, load "
            "traded for the hit, index or pull wrong.",
        ),
        Panel(
            "Cached prompt tokens by source tier",
            ((rate("kvc_prompt_tokens_cached_total", "tier"), "{{tier}}"),),
        ),
        Panel(
            "Predicted vs realised cached tokens",
            (
                (rate("kvc_cache_predicted_tokens_total", "worker"), "{{worker}} predicted"),
                (rate("kvc_cache_realised_tokens_total", "worker"), "{{worker}} realised"),
            ),
        ),
        Panel(
            "Prediction misses and index resyncs (healing)",
            (
                (rate("kvc_cache_prediction_misses_total", "worker"), "{{worker}} misses"),
                (rate("kvc_index_resyncs_total", "worker"), "{{worker}} resyncs"),
            ),
        ),
        Panel(
            "Routing decisions by reason",
            ((rate("kvc_routed_requests_total", "reason"), "{{reason}}"),),
            "reqps",
        ),
        Panel(
            "Routing decision latency (Ray export)",
            tuple(
                (quantile(q, "ray_kvc_route_decision_seconds"), f"p{round(q * 100)}")
                for q in (0.5, 0.99)
            ),
            "s",
        ),
        Panel(
            "Peer pulls",
            (
                (rate("kvc_pulls_total"), "pulls"),
                (rate("kvc_pull_misses_total"), "short"),
                (rate("kvc_pull_slow_total"), "slow"),
            ),
        ),
        Panel(
            "Pulled tokens per second",
            ((rate("kvc_pulled_tokens_total", "worker"), "{{worker}}"),),
        ),
        Panel(
            "Lower tier blocks",
            (
                (
                    "sum by (worker, tier) (kvc_worker_tier_cached_blocks)",
                    "{{worker}} {{tier}} cached",
                ),
                (
                    "sum by (worker, tier) (kvc_worker_tier_total_blocks)",
                    "{{worker}} {{tier}} size",
                ),
            ),
        ),
        Panel(
            "KV block lifetime and idle time before eviction (sampled blocks)",
            (
                *(
                    (worker_quantile(q, "vllm:kv_block_lifetime_seconds"), f"lifetime p{p}")
                    for q, p in ((0.5, 50), (0.9, 90))
                ),
                *(
                    (worker_quantile(q, "vllm:kv_block_idle_before_evict_seconds"), f"idle p{p}")
                    for q, p in ((0.5, 50), (0.9, 90))
                ),
            ),
            "s",
            "Caching to eviction, and unused (in the LRU) before eviction: short idle "
            "times mean the cache is too small for the traffic's reuse.",
        ),
        Panel(
            "KV block reuse gap (sampled blocks)",
            tuple(
                (worker_quantile(q, "vllm:kv_block_reuse_gap_seconds"), f"p{round(q * 100)}")
                for q in (0.5, 0.9, 0.99)
            ),
            "s",
            "Time between two uses of a cached block (its caching, then each prefix hit).",
        ),
        Panel(
            "Index errors and parity mismatches",
            (
                (rate("kvc_router_index_errors_total"), "index errors"),
                (rate("kvc_router_parity_mismatches_total"), "parity mismatches"),
            ),
        ),
    ),
)

NODES_WORKERS = Dashboard(
    "kvcluster-nodes-workers",
    "kvcluster / Nodes and workers",
    "Each worker's queue, blocks and preemptions; its own latencies and gauges through Ray; "
    "the nodes' CPU and memory.",
    (
        Panel(
            "Running and waiting per worker",
            (
                ("max by (worker) (vllm:num_requests_running)", "{{worker}} running"),
                ("max by (worker) (vllm:num_requests_waiting)", "{{worker}} waiting"),
            ),
        ),
        Panel(
            "Free KV blocks per worker",
            (("max by (worker) (kvc_worker_free_blocks)", "{{worker}}"),),
        ),
        Panel(
            "Queued prefill tokens and pinned blocks",
            (
                ("max by (worker) (kvc_worker_queued_prefill_tokens)", "{{worker}} prefill"),
                ("max by (worker) (kvc_worker_waiting_pinned_blocks)", "{{worker}} pinned"),
            ),
        ),
        Panel(
            "Waiting requests by reason",
            (
                (
                    "sum by (reason) (max by (worker, reason) "
                    "(kvc_worker_requests_waiting_by_reason))",
                    "{{reason}}",
                ),
            ),
            description="Why the engines' last admission pass left each waiting request "
            "waiting (kvstore/requests/protocol.py WAIT_REASONS).",
        ),
        Panel(
            "Request phases p90 (in the engine)",
            tuple(
                (worker_quantile(0.9, f"vllm:request_{phase}_time_seconds"), phase)
                for phase in ("queue", "prefill", "decode", "inference")
            ),
            "s",
            "Queue: arrival at the engine to admission; prefill: admission to first token; "
            "decode: first to last token; inference: admission to last token.",
        ),
        Panel(
            "Preemptions per second",
            ((rate("kvc_worker_preemptions_total", "worker, mode"), "{{worker}} {{mode}}"),),
        ),
        Panel(
            "Speculative decoding: draft and accepted tokens per second",
            (
                (rate("vllm:spec_decode_num_draft_tokens_total", "worker"), "{{worker}} drafted"),
                (
                    rate("vllm:spec_decode_num_accepted_tokens_total", "worker"),
                    "{{worker}} accepted",
                ),
            ),
            description="Draft tokens verified and accepted (draft-free proposers: "
            "workers.engine.speculative); none while the adaptive rule has speculation off.",
        ),
        Panel(
            "Speculative decoding: mean acceptance length",
            (
                (
                    f"1 + {rate('vllm:spec_decode_num_accepted_tokens_total', 'worker')} / "
                    f"{rate('vllm:spec_decode_num_drafts_total', 'worker')}",
                    "{{worker}}",
                ),
            ),
            description="Tokens a sequence gains per verify step: 1 + accepted drafts / "
            "sequences that verified drafts.",
        ),
        Panel(
            "Speculative decoding: acceptance by draft position",
            (
                (
                    f"{rate('vllm:spec_decode_num_accepted_tokens_per_pos_total', 'position')}"
                    f" / scalar({rate('vllm:spec_decode_num_drafts_total')})",
                    "position {{position}}",
                ),
            ),
            "percentunit",
            "Share of verify steps whose draft token at each position was accepted "
            "(position 0 = the first draft token).",
        ),
        Panel(
            "Worker TTFT p99 (at the worker, Ray export)",
            ((quantile(0.99, "ray_kvc_ttft_seconds", "worker"), "{{worker}}"),),
            "s",
        ),
        Panel(
            "Worker KV usage and prefix hit rate (Ray export)",
            (
                ("max by (worker) (ray_kvc_kv_usage)", "{{worker}} KV"),
                ("max by (worker) (ray_kvc_prefix_hit_rate)", "{{worker}} hits"),
            ),
            "percentunit",
        ),
        Panel(
            "Node CPU",
            (("avg by (instance) (ray_node_cpu_utilization)", "{{instance}}"),),
            "percent",
        ),
        Panel(
            "Node memory used",
            (("sum by (instance) (ray_node_mem_used)", "{{instance}}"),),
            "bytes",
        ),
        Panel(
            "Scrape targets up",
            (("sum by (job) (up)", "{{job}}"),),
        ),
    ),
)

DASHBOARDS = (OVERVIEW, KV_ROUTING, NODES_WORKERS)


def queries() -> Iterator[tuple[Dashboard, Panel, str]]:
    """Every query of every shipped dashboard."""
    for d in DASHBOARDS:
        for p in d.panels:
            for expr, _ in p.queries:
                yield d, p, expr


def grafana_json(d: Dashboard) -> dict:
    """The Grafana dashboard model of ``d`` (schema 39; Prometheus from a variable)."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels, x, y = [], 0, 0
    for i, p in enumerate(d.panels, start=1):
        if x + p.width > 24:
            x, y = 0, y + 8
        panels.append(
            {
                "id": i,
                "type": "timeseries",
                "title": p.title,
                "description": p.description,
                "datasource": ds,
                "gridPos": {"h": 8, "w": p.width, "x": x, "y": y},
                "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"refId": chr(ord("A") + j), "datasource": ds, "expr": e, "legendFormat": lf}
                    for j, (e, lf) in enumerate(p.queries)
                ],
            }
        )
        x += p.width
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["kvcluster"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "panels": panels,
    }


def render(d: Dashboard) -> str:
    return json.dumps(grafana_json(d), indent=2) + "\n"


def write(out_dir: Path = OUT_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in DASHBOARDS:
        path = out_dir / f"{d.uid}.json"
        path.write_text(render(d))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Write the dashboards' Grafana JSON."""
    p = argparse.ArgumentParser(prog="python -m cluster.dashboards", description=main.__doc__)
    p.add_argument("--out", type=Path, default=OUT_DIR, help=f"folder (default {OUT_DIR})")
    for path in write(p.parse_args(argv).out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
