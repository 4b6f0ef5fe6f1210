"""``model.path: null`` on workers that do not share the head's view of the disk: each worker
(and router) resolves the default model on its own node; the head sends no path.

The head and Ray's processes run with different ``KVCLUSTER_CACHE`` (where the default model
lives): a head-side path would make the workers load the head's copy. Run in a subprocess so
the head's environment can differ from the one Ray's processes inherited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker.model.default_model import default_model_id

pytestmark = [pytest.mark.ray, pytest.mark.redis]

SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys
    head_cache, node_cache = sys.argv[1], sys.argv[2]
    os.environ["KVCLUSTER_CACHE"] = node_cache  # what Ray's processes will see
    import ray
    from benchmarks.chaos_probes import on_workers
    from cluster.client import KVClusterClient
    from cluster.launcher import Cluster
    from cluster.local_ray import use_loopback_ray
    from tests.cluster.conftest import cluster_config
    use_loopback_ray()
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)
    os.environ["KVCLUSTER_CACHE"] = head_cache  # the head's own view
    cfg = cluster_config("default-model", workers={"num_workers": 1})
    with Cluster(cfg) as c:
        dirs = on_workers(c, lambda w: w.model_dir)
        with KVClusterClient(c.endpoints[0]) as client:
            out = client.generate("Where is my model?", max_tokens=2, timeout=60)
        print(json.dumps({"dirs": dirs, "tokens": out.completion_tokens,
                          "model_id": c.model_id, "sent": c.model_path}))
    """
)


def test_workers_resolve_the_default_model_on_their_own_node(tmp_path: Path) -> None:
    head, node = tmp_path / "head-cache", tmp_path / "node-cache"
    env = {k: v for k, v in os.environ.items() if k != "KVCLUSTER_CACHE"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(head), str(node)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 2
    assert got["sent"] is None and got["model_id"] == default_model_id("llama")
    # the worker loaded its own node's copy; the head resolved nothing
    (worker_dir,) = got["dirs"].values()
    assert Path(worker_dir).is_relative_to(node), worker_dir
    assert Path(worker_dir).name == got["model_id"]
    assert not (head / "models").exists()
