"""One real cluster per test package: local Ray, real redis-server, real gRPC, tiny model."""

from __future__ import annotations

import os

import pytest

from cluster.client import KVClusterClient
from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from tests.embedded_ray import shared_ray

ENGINE = {
    "num_blocks": 128,
    "block_size": 16,
    "max_waiting": 32,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 256,
    "max_model_len": 512,
}


def cluster_config(name: str, **overrides: object) -> ClusterConfig:
    """A small test cluster: 2 workers, 1 router on a free port, no dashboard."""
    raw: dict = {
        "name": name,
        "dashboard": False,
        "model": {"tiny_family": "llama"},
        "workers": {"num_workers": 2, "num_cpus_per_worker": 0.1, "engine": dict(ENGINE)},
        "router": {"port": 0, "http_port": 0},
        "redis": {"heartbeat_ttl_s": 2.0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return ClusterConfig.model_validate(raw)


@pytest.fixture(scope="package")
def cluster() -> Cluster:
    shared_ray()  # every cluster of the session on one Ray
    with Cluster(cluster_config(f"test-{os.getpid()}")) as c:
        yield c


@pytest.fixture
def client(cluster: Cluster) -> KVClusterClient:
    with KVClusterClient(cluster.endpoints[0]) as c:
        yield c
