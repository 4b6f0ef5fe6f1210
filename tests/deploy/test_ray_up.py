"""`ray up deploy/local.yaml -y` for real against this machine: a throwaway sshd on loopback,
Ray's local provider, the head's start commands (Ray, then `kvcluster up`: Redis, a worker and
a router), one gRPC Generate, `kvcluster down`, `ray down`, and nothing left running.

The test's copy of local.yaml differs only where a test must: the host (127.0.0.1 through the
throwaway sshd), the SSH key, this checkout mounted into a temporary folder whose `.venv` links
to this checkout's venv (no reinstall), free ports, a one-worker kvcluster config, and no
`ray stop` (it would stop every Ray on the machine, other test sessions' included)."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from cluster.client import KVClusterClient
from tests.deploy.sshd import LoopbackSSHD, free_port, listening, missing_tools

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.redis]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY = VENV_BIN / "ray"
BOOTSTRAP_FILES = [Path.home() / "ray_bootstrap_config.yaml", Path.home() / "ray_bootstrap_key.pem"]


def require_harness() -> None:
    """Skip (naming the reason) where the harness cannot run."""
    if os.geteuid() != 0:
        pytest.skip("ray up test needs root (sshd with PermitRootLogin on loopback)")
    missing = missing_tools()
    if missing:
        pytest.skip(
            f"missing {missing}: run `bash deploy/dev.sh install` (apt openssh-server rsync)"
        )


def marked_processes(marker: str) -> list[int]:
    """Pids whose environment holds ``marker`` (every process our commands started)."""
    want = marker.encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if want in (entry / "environ").read_bytes().split(b"\0"):
                out.append(int(entry.name))
        except OSError:  # gone, or a kernel thread
            continue
    return out


def stop_marked(marker: str, grace_s: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in marked_processes(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.2)


def adapted_yaml(
    tmp: Path,
    sshd: LoopbackSSHD,
    name: str,
    marker: str,
    gcs_port: int,
    dash_port: int,
    kv_config: Path,
) -> Path:
    """deploy/local.yaml, adapted to this machine as the module docstring says."""
    cfg = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
    node_dir = tmp / "node" / "kvcluster"
    cfg["cluster_name"] = name
    cfg["provider"].update(head_ip="127.0.0.1", worker_ips=[])
    cfg["auth"] = {
        "ssh_user": "root",
        "ssh_private_key": str(sshd.key),
        "ssh_proxy_command": str(sshd.proxy),
    }
    cfg["min_workers"] = cfg["max_workers"] = 0
    cfg["file_mounts"] = {str(node_dir): str(REPO)}
    cfg["setup_commands"] = [
        f"ln -sfn {VENV_BIN.parent} {node_dir}/.venv",
        f"cd {node_dir} && .venv/bin/python -m protos.build",
    ]

    def adapt(cmd: str) -> str:
        cmd = (
            cmd.replace("~/kvcluster", str(node_dir))
            .replace("deploy/kvcluster.yaml", str(kv_config))
            .replace(
                "--port=6380",
                f"--port={gcs_port} --node-ip-address=127.0.0.1 "
                f"--dashboard-port={dash_port} --num-cpus=2",
            )
            .replace("--dashboard-host=0.0.0.0", "--dashboard-host=127.0.0.1")
            .replace("--ray-address auto", f"--ray-address 127.0.0.1:{gcs_port}")
        )
        return f"export {marker}; {cmd}"

    starts = [c for c in cfg["head_start_ray_commands"] if not c.endswith("ray stop")]
    assert len(starts) == 2 and "ray start --head" in starts[0] and "kvcluster up" in starts[1]
    cfg["head_start_ray_commands"] = [adapt(c) for c in starts]
    path = tmp / "local.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ssh_control_dir(cluster_name: str) -> Path:
    """Where Ray's SSH runner keeps this cluster's ControlMaster sockets."""
    user = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]
    return Path(f"/tmp/ray_ssh_{user}") / hashlib.sha256(cluster_name.encode()).hexdigest()[:10]


def ray_cli(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run(
        [str(RAY), *args], capture_output=True, text=True, env=env, timeout=timeout_s, cwd=REPO
    )


def test_ray_up_serves_grpc_then_ray_down(tmp_path: Path) -> None:
    require_harness()
    tmp = tmp_path
    name = f"kvc-rayup-{uuid.uuid4().hex[:8]}"
    marker = f"KVCLUSTER_STATE_DIR={tmp / 'state'}"
    gcs_port, dash_port, grpc_port = free_port(), free_port(), free_port()
    kv_config = tmp / "kvcluster.yaml"
    kv_config.write_text(
        yaml.safe_dump(
            {
                "name": name,
                "dashboard": False,
                "model": {"tiny_family": "llama"},
                "workers": {
                    "num_workers": 1,
                    "num_cpus_per_worker": 0.5,
                    "engine": {"num_blocks": 64, "max_num_seqs": 4},
                },
                "router": {"num_routers": 1, "host": "127.0.0.1", "port": grpc_port},
            }
        )
    )
    saved = {p: p.read_bytes() for p in BOOTSTRAP_FILES if p.exists()}
    sshd = LoopbackSSHD(tmp / "ssh").start()
    ray_yaml = adapted_yaml(tmp, sshd, name, marker, gcs_port, dash_port, kv_config)
    state_file = tmp / "state" / f"{name}.json"
    redis_port = None
    try:
        # `ray down` runs a bare `ray stop` on the head: only safe if it cannot find a Ray that
        # stops other clusters on this machine.
        probe = sshd.ssh("command -v ray || echo none")
        assert probe.returncode == 0, probe.stderr
        if probe.stdout.strip().splitlines()[-1] != "none":
            pytest.skip(
                f"`ray` is on root's login PATH ({probe.stdout.strip()}): `ray down` "
                "would stop every Ray on this machine"
            )
        t0 = time.monotonic()
        up = ray_cli("up", str(ray_yaml), "-y", "--no-config-cache", timeout_s=300)
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        assert "is up" in up.stdout, up.stdout[-4000:]
        state = json.loads(state_file.read_text())
        assert state["endpoints"] == [f"127.0.0.1:{grpc_port}"]
        redis_port = int(state["redis_url"].rsplit(":", 1)[1].split("/")[0])
        assert listening(redis_port)

        with KVClusterClient(state["endpoints"][0]) as client:
            out = client.generate("Hello from ray up", max_tokens=4, temperature=0.0, timeout=120)
        assert out.completion_tokens == 4 and len(out.token_ids[0]) == 4
        assert out.worker_id in state["workers"]

        down = ray_cli(
            "exec",
            str(ray_yaml),
            f"{marker} {VENV_BIN}/kvcluster down --name {name}",
            timeout_s=120,
        )
        assert down.returncode == 0, down.stdout[-4000:] + down.stderr[-4000:]
        assert not state_file.exists()
        assert not listening(grpc_port) and not listening(redis_port)
        rd = ray_cli("down", str(ray_yaml), "-y", timeout_s=120)
        assert rd.returncode == 0, rd.stdout[-4000:] + rd.stderr[-4000:]
        print(f"ray up -> generate -> down in {time.monotonic() - t0:.1f}s")
    finally:
        if state_file.exists():  # a failure before `kvcluster down`
            subprocess.run(
                [str(VENV_BIN / "kvcluster"), "down", "--name", name],
                timeout=60,
                env=dict(os.environ, KVCLUSTER_STATE_DIR=str(tmp / "state")),
                capture_output=True,
            )
        subprocess.run(
            [str(RAY), "down", str(ray_yaml), "-y"], capture_output=True, timeout=120, cwd=REPO
        )
        # `ray down`'s bare `ray stop` found no Ray here (see the probe): stop exactly the
        # processes our commands started (they carry the marker), then our sshd.
        stop_marked(marker)
        sshd.stop()
        for p in BOOTSTRAP_FILES:
            if p in saved:
                p.write_bytes(saved[p])
            else:
                p.unlink(missing_ok=True)
        for suffix in (".state", ".lock"):
            Path(f"/tmp/cluster-{name}{suffix}").unlink(missing_ok=True)
        shutil.rmtree(ssh_control_dir(name), ignore_errors=True)
        try:  # Ray's per-user folder, if only this test used it
            ssh_control_dir(name).parent.rmdir()
        except OSError:
            pass
    assert marked_processes(marker) == []
    ports = [gcs_port, dash_port, grpc_port, sshd.port] + ([redis_port] if redis_port else [])
    assert [p for p in ports if listening(p)] == []
