"""``kvcluster bench --compare-policies``: the per-policy cluster config and figures (pure),
and the benchmark's command line on real clusters (local Ray, real redis-server, real gRPC)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from benchmarks import cluster_bench
from benchmarks.loadgen import Sample
from benchmarks.policy_bench import (
    SMOKE,
    PolicyResult,
    check_policies,
    cluster_config,
    headline,
    parse_seeds,
    table_rows,
)
from cluster.config import ClusterConfig, ConfigError
from tests.cluster.conftest import ENGINE


def sample(ttft_s: float, prompt: int = 100, cached: int = 0, ok: bool = True) -> Sample:
    return Sample(
        ok, "OK" if ok else "UNAVAILABLE", ttft_s + 0.1, ttft_s, "worker-0", prompt, cached, 4
    )


def test_base_config_keeps_its_settings_and_takes_the_policy() -> None:
    base = ClusterConfig.model_validate(
        {
            "name": "prod",
            "router": {"port": 50051, "routing": {"policy": "least_loaded"}},
            "workers": {"num_workers": 3, "num_cpus_per_worker": 0.25, "engine": ENGINE},
            "redis": {"heartbeat_ttl_s": 7.0},
        }
    )
    w = replace(SMOKE, model_size=None, num_workers=2)
    cfg = cluster_config("prefix_affinity", w, base)
    assert cfg.router.routing.policy == "prefix_affinity"
    assert cfg.router.port == 0 and cfg.name != "prod" and not cfg.dashboard
    assert cfg.workers.num_workers == 2
    assert cfg.workers.num_cpus_per_worker == 0.25
    assert cfg.workers.engine.num_blocks == ENGINE["num_blocks"]  # not the workload's
    assert cfg.redis.heartbeat_ttl_s == 7.0 and cfg.model.path is None


def test_embedded_config_is_sized_by_the_workload() -> None:
    cfg = cluster_config("round_robin", replace(SMOKE, num_workers=4))
    assert cfg.workers.num_workers == 4
    assert cfg.workers.engine.num_blocks == SMOKE.num_blocks
    assert cfg.router.routing.policy == "round_robin"
    assert Path(cfg.model.path, "config.json").exists()  # the offline tiny model


def test_unknown_policy_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="least_loaded"):
        check_policies(["round_robin", "fastest"])


def test_ratios_and_headline_against_round_robin() -> None:
    rr = PolicyResult("round_robin", [sample(2.0), sample(4.0)], wall_s=4.0)
    pa = PolicyResult(
        "prefix_affinity",
        [sample(1.0, cached=80), sample(0.5, cached=80), sample(9.0, ok=False)],
        wall_s=1.0,
    )
    rows = table_rows([rr, pa])
    assert [r["policy"] for r in rows] == ["round_robin", "prefix_affinity"]
    assert rows[1]["ok"] == 2 and rows[1]["hit_rate"] == 0.8
    assert rows[1]["ttft_vs_rr"] == pytest.approx(0.25)  # 0.75 s vs 3 s mean
    assert rows[1]["thru_vs_rr"] == pytest.approx(4.0)  # 2 req/s vs 0.5
    head = headline([rr, pa])
    assert head["ttft_ratio_vs_rr"] == 0.25 and head["throughput_ratio_vs_rr"] == 4.0
    assert head["targets_met"] is True
    assert "ttft_ratio_vs_rr" not in headline([pa])  # no baseline, no ratios


def test_seeds_pool_into_a_ratio_of_seed_means() -> None:
    """Several seeds: one row per policy over all of them (walls summed); the target is
    judged on the pooled means, and each seed's own ratio is listed too."""
    results = [
        PolicyResult("round_robin", [sample(2.0), sample(2.0)], wall_s=2.0, seed=0),
        PolicyResult("prefix_affinity", [sample(0.5), sample(0.5)], wall_s=1.0, seed=0),
        PolicyResult("round_robin", [sample(4.0), sample(4.0)], wall_s=4.0, seed=1),
        PolicyResult("prefix_affinity", [sample(2.5), sample(2.5)], wall_s=2.0, seed=1),
    ]
    rows = table_rows(results)
    assert [r["policy"] for r in rows] == ["round_robin", "prefix_affinity"]
    assert rows[0]["ok"] == 4 and rows[0]["req_s"] == pytest.approx(4 / 6)
    head = headline(results)
    assert head["ttft_ratio_vs_rr"] == 0.5  # 1.5 s vs 3 s: the mean of each seed's mean
    assert head["ttft_ratio_per_seed"] == [0.25, 0.625]  # the second seed alone misses
    assert head["seeds"] == [0, 1] and head["targets_met"] is True
    assert "seeds" not in headline(results[:2])  # one seed: the keys of a single run


def test_seeds_flag_parses_and_rejects_with_the_value() -> None:
    assert parse_seeds("0,1,2") == (0, 1, 2) and parse_seeds("7") == (7,)
    with pytest.raises(ConfigError, match="'0,x'"):
        parse_seeds("0,x")
    with pytest.raises(ConfigError, match="repeats"):
        parse_seeds("1,1")


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_cli_compare_policies_on_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, ray_shared
) -> None:
    """Two real clusters in turn (round_robin, prefix_affinity), two seeds of 6 requests
    each on each: ``kvcluster bench``'s benchmark in this process, its clusters on the
    session's Ray (that ``kvcluster bench`` hands its arguments to it: test_cli_bench.py)."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({"redis": {"heartbeat_ttl_s": 2.0}}))
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # compare() sets them if unset
        monkeypatch.setenv(var, os.environ.get(var, "1"))
    code = cluster_bench.main(
        [
            "--compare-policies",
            "--config",
            str(tmp_path / "base.yaml"),
            "--model-size",
            "tiny",
            "--workers",
            "2",
            "--requests",
            "6",
            "--concurrency",
            "3",
            "--groups",
            "2",
            "--max-tokens",
            "3",
            "--policies",
            "round_robin,prefix_affinity",
            "--seeds",
            "0,1",
        ]
    )
    run = capsys.readouterr()
    assert code == 0, run.err[-3000:]
    lines = run.out.strip().splitlines()
    head = json.loads(lines[-1])
    for policy in ("round_robin", "prefix_affinity"):
        assert {f"{policy}_ttft_mean_s", f"{policy}_req_s", f"{policy}_hit_rate"} <= set(head)
        assert f"{policy}: 12/12 ok" in run.out  # both seeds, one cluster
    assert "  seed 1: 6/6 ok" in run.out
    assert {"ttft_ratio_vs_rr", "throughput_ratio_vs_rr", "targets_met"} <= set(head)
    assert head["seeds"] == [0, 1] and len(head["ttft_ratio_per_seed"]) == 2
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["policy", "ok"])
    assert lines[header].split() == [
        "policy",
        "ok",
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "req_s",
        "out_tok_s",
        "hit_rate",
        "ttft_vs_rr",
        "thru_vs_rr",
    ]
    rows = {line.split()[0]: line.split() for line in lines[header + 2 : header + 4]}
    assert set(rows) == {"round_robin", "prefix_affinity"}
    assert all(r[1] == "12" for r in rows.values())  # every request succeeded
    assert rows["round_robin"][-2:] == ["1.000", "1.000"]  # ratios vs itself
    assert (tmp_path / "cluster_policies.png").exists()
