"""The components' settings follow from the cluster config: every router config field reaches
the router, every index setting reaches the index config (no cluster, no Ray)."""

from __future__ import annotations

import ast
from pathlib import Path

from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from kvstore.config import IndexSettings
from router.server import RouterSettings
from router.server_config import LAUNCHER_FIELDS, RouterConfig

ROOT = Path(__file__).resolve().parents[2]


def _reads_in_router_server() -> tuple[set[str], set[str]]:
    """(fields read off the router config, fields read off the settings) in RouterServer:
    attributes of ``cfg`` or ``….config``, and of ``s`` or ``….settings``."""
    tree = ast.parse((ROOT / "router" / "server.py").read_text())
    server = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RouterServer")
    config_reads, settings_reads = set(), set()
    for node in ast.walk(server):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
        if name in ("cfg", "config"):
            config_reads.add(node.attr)
        elif name in ("s", "settings"):
            settings_reads.add(node.attr)
    return config_reads, settings_reads


def test_every_router_config_field_reaches_the_router() -> None:
    config_reads, settings_reads = _reads_in_router_server()
    per_router = {"port", "http_port"}  # read through their per-router values in the settings
    missing = set(RouterConfig.model_fields) - LAUNCHER_FIELDS - per_router - config_reads
    assert not missing, f"RouterConfig fields the router never reads: {sorted(missing)}"
    unread = set(RouterSettings.__dataclass_fields__) - settings_reads
    assert not unread, f"RouterSettings fields the router never reads: {sorted(unread)}"
    assert per_router <= settings_reads
    assert LAUNCHER_FIELDS <= set(RouterConfig.model_fields)


def test_router_settings_carry_the_router_config_as_stated() -> None:
    cfg = ClusterConfig.model_validate(
        {
            "model": {"model_id": "m", "tiny_family": "llama"},
            "router": {
                "port": 7000,
                "http_port": 9000,
                "cors_allowed_origins": ["https://a.example"],
                "auth_tokens": {"alice": "tok-a"},
                "routing": {"policy": "least_loaded"},
            },
        }
    )
    settings = Cluster(cfg).router_settings(2)
    assert settings.config is cfg.router
    assert (settings.router_id, settings.port, settings.http_port) == ("router-2", 7002, 9002)
    assert settings.block_size == cfg.workers.engine.block_size
    assert settings.default_family == "llama" and settings.sched == cfg.scheduling


def test_every_index_setting_reaches_the_index_config() -> None:
    changed = {"record_every": 4, "lookup": "scan", "heartbeat_ttl_s": 7.0}
    changed |= {"socket_timeout_s": 0.7, "connect_timeout_s": 0.9}
    assert set(changed) | {"url"} == set(IndexSettings.model_fields)
    cfg = ClusterConfig.model_validate(
        {"model": {"model_id": "m"}, "redis": {"url": "redis://127.0.0.1:1/0", **changed}}
    )
    index = Cluster(cfg).index_config()
    assert index is not None and index.url == "redis://127.0.0.1:1/0"
    assert {k: getattr(index, k) for k in changed} == changed
    assert (index.cluster, index.model_id) == (cfg.name, "m")
