"""Cluster config: typed, frozen, unknown keys rejected with the key named (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig, ConfigError, load_config
from cluster.launcher import Cluster

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
        # the kernel's range of a slice, a niceness, and no unknown key
        ("scheduling: {loop_slice_ms: 0.01}", "scheduling.loop_slice_ms"),
        ("scheduling: {compute_nice: 25}", "scheduling.compute_nice"),
        ("scheduling: {loop_slice: 1}", "scheduling.loop_slice"),
        # a warm start is bounded: how many prefixes, and what share of the KV cache
        (
            "router: {routing: {pull: {warm_start_prefixes: 5000}}}",
            "router.routing.pull.warm_start_prefixes",
        ),
        (
            "router: {routing: {pull: {warm_start_share: 1.5}}}",
            "router.routing.pull.warm_start_share",
        ),
        # the HTTP door's bounds: a positive cap, rate and wait
        ("router: {http_max_connections: 0}", "router.http_max_connections"),
        ("router: {http_cheap_rate_per_s: 0}", "router.http_cheap_rate_per_s"),
        ("router: {http_cheap_max_waiting: -1}", "router.http_cheap_max_waiting"),
        # an empty token would let every caller without one in as that tenant
        ("router: {auth_tokens: {anon: ''}}", "'anon' has an empty token"),
        ("router: {auth_tokens: {a: tok-1, b: tok-1}}", "'a' and 'b' have the same token"),
        ("router: {auth_tokens: {'a#b': tok-1}}", "without '#'"),
        # an owned adapter needs authenticated tenants, and owners that are tenants
        (
            "workers: {engine: {lora_adapters: {x: /a}, lora_tenants: {x: [alice]}}}",
            "lora_tenants (x) needs router.auth_tokens",
        ),
        (
            "workers: {engine: {lora_adapters: {x: /a}, lora_tenants: {x: [alize]}}}\n"
            "router: {auth_tokens: {alice: tok-1}}",
            "lora_tenants['x'] names ['alize'], not tenants of router.auth_tokens (alice)",
        ),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, yaml_text: str, needle: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value)
    assert "tok-1" not in str(info.value)  # tokens are never echoed


def test_config_is_frozen() -> None:
    cfg = ClusterConfig()
    with pytest.raises(Exception, match="frozen"):
        cfg.name = "other"  # type: ignore[misc]


# Each fact (model id, block size, max_model_len) is stated once in the cluster config; the
# components' settings are derived from it, so two disagreeing statements cannot be written.
@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"router": {"routing": {"block_size": 32}}}, "router.routing.block_size"),
        ({"workers": {"engine": {"model_id": "other"}}}, "workers.engine.model_id"),
        ({"router": {"limits": {"max_model_len": 64}}}, "router.limits.max_model_len"),
    ],
)
def test_a_fact_has_one_place_in_the_config(raw: dict, needle: str, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"model_id": "m"}, **raw}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value)
    assert "Extra inputs are not permitted" in str(info.value)


def test_dump_and_load_round_trip(tmp_path: Path) -> None:
    """A config shipped as a dump (to Ray actors, to a YAML file) loads back equal."""
    cfg = ClusterConfig.model_validate(
        {
            "model": {"model_id": "m", "tiny_family": "qwen3"},
            "workers": {"engine": {"block_size": 32, "max_model_len": 256, "num_blocks": 64}},
            "router": {"routing": {"policy": "least_loaded"}, "limits": {"max_n": 4}},
            "redis": {"record_every": 4},
        }
    )
    assert ClusterConfig.model_validate(cfg.model_dump()) == cfg
    path = tmp_path / "dumped.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert load_config(path) == cfg


def test_components_derive_the_facts_from_the_cluster_config() -> None:
    """Workers, routers and the index get the model id, block size and max_model_len from
    the one place each is stated (no cluster is started)."""
    cfg = ClusterConfig.model_validate(
        {
            "redis": {"url": "redis://127.0.0.1:1/0"},
            "model": {"model_id": "m", "tiny_family": "llama"},
            "workers": {"engine": {"block_size": 32, "max_model_len": 256}},
            "router": {
                "port": 6000,
                "http_port": None,
                "http_max_connections": 7,
                "stream_interval": 3,
            },
            "scheduling": {"loop_slice_ms": 0.5, "compute_nice": 2},
        }
    )
    cluster = Cluster(cfg)
    worker = cluster.worker_settings("worker-0")
    router = cluster.router_settings(1)
    assert worker.model_id == router.model_id == worker.index.model_id == router.index.model_id
    assert worker.model_id == "m"
    assert router.index == worker.index
    assert worker.engine.block_size == router.block_size == 32
    assert worker.engine.max_model_len == router.max_model_len == 256
    assert router.port == 6001 and router.http_port is None
    assert router.config.http_max_connections == 7 and router.config.http_cheap_rate_per_s == 200.0
    assert router.config.stream_interval == 3
    assert worker.engine == cfg.workers.engine  # the engine config is shipped as stated
    assert worker.sched == router.sched == cfg.scheduling  # one thread policy for both
    assert cfg.scheduling.loop_slice_ms == 0.5 and cfg.scheduling.compute_nice == 2


@pytest.mark.parametrize("bad", [0, 65])
def test_stream_interval_names_its_bounds(bad: int) -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        ClusterConfig.model_validate({"router": {"stream_interval": bad}})


@pytest.mark.parametrize(("side", "bad"), [("workers", 20), ("workers", -1), ("router", 20)])
def test_niceness_is_a_priority_ray_can_set(side: str, bad: int) -> None:
    """0..19: lowering a process below 0 needs a privilege Ray's raylet may not have."""
    with pytest.raises(ValueError, match="niceness"):
        ClusterConfig.model_validate({side: {"niceness": bad}})


def test_served_processes_run_at_normal_priority_unless_told() -> None:
    from cluster.settings import actor_env

    cfg = ClusterConfig.model_validate({})
    assert cfg.workers.niceness == cfg.router.niceness == 0
    assert actor_env(7) == {"env_vars": {"RAY_worker_niceness": "7"}}
