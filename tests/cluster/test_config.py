"""Cluster config: typed, frozen, unknown keys rejected with the key named (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_example_yaml_loads_and_documents_every_key() -> None:
    cfg = load_config(ROOT / "deploy" / "kvcluster.yaml")
    assert cfg.router.routing.policy == "prefix_affinity"
    assert cfg.workers.engine.block_size == 16 and cfg.workers.engine.num_blocks == 512
    lines = (ROOT / "deploy" / "kvcluster.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#") and ":" in line:
            assert lines[i - 1].lstrip().startswith("#"), f"key without a comment: {line!r}"


def test_gpu_example_yaml_loads() -> None:
    """The config deploy/cluster-aws.yaml's head starts: GPU workers, long start timeout."""
    cfg = load_config(ROOT / "deploy" / "kvcluster-gpu.yaml")
    assert cfg.workers.use_gpu and cfg.workers.engine.device == "cuda"
    assert cfg.workers.start_timeout_s == 1200 and cfg.ray_address == "auto"
    assert "kvcluster-gpu.yaml" in (ROOT / "deploy" / "cluster-aws.yaml").read_text()


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("workerz: {}", "workerz"),
        ("workers: {engine: {block_sise: 8}}", "workers.engine.block_sise"),
        ("redis: {url: 'http://x'}", "redis.url"),
        ("router: {routing: {policy: best}}", "best"),
        ("workers: {num_workers: 0}", "workers.num_workers"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, yaml_text: str, needle: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value)


def test_config_is_frozen() -> None:
    cfg = ClusterConfig()
    with pytest.raises(Exception, match="frozen"):
        cfg.name = "other"  # type: ignore[misc]
