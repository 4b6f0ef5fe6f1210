"""benchmarks.kv_pull_cluster ``--repeat``: every configuration runs that many times, in
alternating order, and each (policy, pull, load) cell keeps its run of the highest req/s;
failures count over every run. ``_run`` is replaced, so no cluster starts."""

from __future__ import annotations

import pytest

from benchmarks import kv_pull_cluster


def test_repeat_alternates_and_keeps_each_cells_fastest_run(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    order: list[tuple[str, bool]] = []
    speed = {  # req/s of each configuration's runs: the second run is faster for some
        ("least_loaded", False): [1.0, 2.0],
        ("least_loaded", True): [8.0, 4.0],
        ("prefix_affinity", False): [10.0, 12.0],
        ("prefix_affinity", True): [12.0, 11.0],
    }

    def fake_run(policy: str, pull: bool, args) -> list[dict]:  # noqa: ANN001
        n = sum(1 for o in order if o == (policy, pull))
        order.append((policy, pull))
        args.hot_set_x = 2.5
        return [
            {
                "policy": policy,
                "pull": "on" if pull else "off",
                "concurrency": c,
                "failed": 1 if (policy, pull, n) == ("least_loaded", True, 1) else 0,
                "req_s": speed[(policy, pull)][n] * c,
                "ttft_p99_s": 1.0 / speed[(policy, pull)][n],
                "hit_rate": 0.5,
            }
            for c in (1, 2)
        ]

    monkeypatch.setattr(kv_pull_cluster, "_run", fake_run)
    monkeypatch.setattr(kv_pull_cluster, "print_table", lambda *a, **k: None)
    monkeypatch.setattr(kv_pull_cluster, "_plot", lambda *a, **k: None)
    head = kv_pull_cluster.main(["--loads", "1,2", "--repeat", "2"])
    configs = list(kv_pull_cluster.CONFIGS)
    assert order == configs + configs[::-1]  # forward, then backward
    assert head["req_s_least_loaded"] == [2.0, 4.0]
    assert head["req_s_least_loaded_pull"] == [8.0, 16.0]
    assert head["least_loaded_pull_req_s_ratios"] == [4.0, 4.0]
    assert head["affinity_pull_req_s_ratios"] == [1.0, 1.0]  # 12 vs 12
    assert head["affinity_pull_p99_ttft_ratio_top"] == pytest.approx(1.0, abs=1e-3)
    assert head["failures"] == 2 and head["repeat"] == 2  # the slower run's, not kept
