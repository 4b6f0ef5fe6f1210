"""The KV benchmarks run at smoke size and end with one parseable JSON line of headlines."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_memory, kv_throughput


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_kv_memory_smoke(capsys: pytest.CaptureFixture, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    returned = kv_memory.main(["--smoke"])
    head = _last_json(capsys.readouterr().out)
    assert head == returned
    # Seeded workload: paging wastes only the partial last block of each request.
    assert head["kv_mem_paged16_util_pct"] > head["kv_mem_contig_reserve_util_pct"]
    assert head["kv_mem_contig_reserve_util_pct"] > head["kv_mem_contig_maxlen_util_pct"]
    assert head["kv_mem_paged16_peak_reqs"] > head["kv_mem_contig_maxlen_peak_reqs"]
    assert (tmp_path / "kv_memory_block_size.png").stat().st_size > 0


def test_kv_throughput_smoke(capsys: pytest.CaptureFixture, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    returned = kv_throughput.main(["--smoke"])
    head = _last_json(capsys.readouterr().out)
    assert head == returned
    assert head["kv_tp_2k_hit_rate"] == 0.5  # exactly half of every prompt is a cached prefix
    assert head["kv_tp_2k_ops_per_s"] > 0 and head["kv_tp_decode_us_per_step"] > 0
    assert (tmp_path / "kv_throughput_scaling.png").stat().st_size > 0


def test_fleet_eviction_smoke(capsys: pytest.CaptureFixture) -> None:
    from benchmarks import fleet_eviction

    returned = fleet_eviction.main(["--smoke"])
    head = _last_json(capsys.readouterr().out)
    assert head == returned and head["smoke"] is True
    for order in fleet_eviction.ORDERS:
        assert 0 < head[f"coverage_{order}_40"] <= 1


def test_disk_tier_smoke(capsys: pytest.CaptureFixture, monkeypatch, tmp_path) -> None:
    from benchmarks import disk_tier

    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    returned = disk_tier.main(["--smoke"])
    head = _last_json(capsys.readouterr().out)
    assert head == returned and head["smoke"] is True
    assert head["outputs_identical"] is True
    assert head["working_set_x"] >= 3.5
    assert head["hit_rate_disk"] > head["hit_rate_host_only"] and head["hit_disk_share"] > 0
    assert head["restart_hit_warm"] > head["restart_hit_cold"]
    assert head["read_blocks_per_s"] > 0 and head["recompute_blocks_per_s"] > 0
    assert (tmp_path / "disk_tier.png").stat().st_size > 0
