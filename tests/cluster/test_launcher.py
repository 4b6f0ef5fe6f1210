"""`kvcluster up` / `down` in detached mode: our own Ray head and redis-server, stopped exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.client import KVClusterClient
from cluster.state import group_alive
from tests.cluster.conftest import ENGINE
from tests.cluster.sockets import dashboard_processes, descendants, listeners, process_group

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def test_up_generate_status_down(tmp_path: Path) -> None:
    name = f"updown-{os.getpid()}"
    cfg = {
        "name": name,
        "dashboard": False,
        "model": {"tiny_family": "llama"},
        "workers": {"num_workers": 1, "num_cpus_per_worker": 0.1, "engine": ENGINE},
        "router": {"port": 0, "http_port": 0},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "KVCLUSTER_STATE_DIR": str(tmp_path)}
    cli = [sys.executable, "-m", "cluster.cli"]
    up = subprocess.run(
        [*cli, "up", "--config", str(tmp_path / "c.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    state_file = tmp_path / f"{name}.json"
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert "gRPC endpoints" in up.stdout and "dashboard" in up.stdout
        state = json.loads(state_file.read_text())
        # the CLI process has exited: the actors, Ray head and Redis live on
        with KVClusterClient(state["endpoints"][0]) as client:
            out = client.generate("detached clusters outlive the CLI", max_tokens=3)
        assert out.completion_tokens == 3 and out.worker_id == "worker-0"
        st = subprocess.run(
            [*cli, "status", "--name", name], env=env, capture_output=True, text=True, timeout=120
        )
        assert st.returncode == 0 and "worker-0" in st.stdout, st.stderr
        assert f"routers: {state['endpoints'][0]} (up)" in st.stdout  # every router, probed
        # the router's predicted vs realised cache hits: the request above was placed once
        lines = st.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if "predicted" in line)
        assert lines[header].split() == [
            "worker", "predicted", "realised", "placed", "misses", "gap", "now", "resyncs",
            "pulled", "pulls", "missed", "slow", "evicted",
        ]  # fmt: skip
        row = next(line.split() for line in lines[header:] if line.startswith("worker-0"))
        assert int(row[3]) >= 1, st.stdout
        # every port of the head, its workers and routers and Redis is on loopback
        pids = process_group(state["ray_pid"]) | descendants(state["redis_pid"])
        mine = listeners(pids)
        assert {"gcs_server", "raylet", "redis-server"} <= {e.command for e in mine}, mine
        assert not [e for e in mine if not e.loopback], mine
        # dashboard: false means no dashboard, nor Ray's dashboard process
        assert state["dashboard_url"] is None and "dashboard      : off" in up.stdout
        assert not dashboard_processes(pids)
        # the OpenAI HTTP API's URL is printed (and it listens on loopback, checked above)
        assert f"OpenAI API     : {state['http_endpoints'][0]}/v1" in up.stdout, up.stdout
        # the Ray CLI works against the head as `up` says (token auth, README)
        hint = (
            f"RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 ray status "
            f"--address {state['ray_address']}"
        )
        assert hint in up.stdout
        # its Prometheus (when installed): URL printed by up and status, on loopback
        if shutil.which("prometheus"):
            assert f"prometheus     : {state['prometheus_url']}" in up.stdout, up.stdout
            assert f"prometheus {state['prometheus_url']}" in st.stdout, st.stdout
            assert all(e.loopback for e in listeners(process_group(state["prometheus_pid"])))
        ray_cli = str(Path(sys.executable).with_name("ray"))
        ray_status = subprocess.run(
            [ray_cli, "status", "--address", state["ray_address"]],
            env={**env, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ray_status.returncode == 0 and "Resources" in ray_status.stdout, (
            ray_status.stdout[-2000:] + ray_status.stderr[-2000:]
        )
        gen = subprocess.run(
            [
                *cli,
                "generate",
                "--name",
                name,
                "--chat",
                "Hi!",
                "--system",
                "Be brief.",
                "--max-tokens",
                "3",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        # rendered with the tiny model's ChatML template (Tokenizer.encode_chat: 32 tokens)
        assert gen.returncode == 0 and "prompt 32 tokens" in gen.stdout, gen.stderr[-3000:]
    finally:
        down = subprocess.run(
            [*cli, "down", "--name", name], env=env, capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stderr[-3000:]
    assert not state_file.exists()
    # exactly our Ray head and redis-server are gone (down waits for them)
    assert not group_alive(state["ray_pid"])
    assert not group_alive(state["redis_pid"])
    if state["prometheus_pid"]:
        assert not group_alive(state["prometheus_pid"])
