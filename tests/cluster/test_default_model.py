"""``model.path: null`` on workers that do not share the head's view of the disk: each worker
(and router) resolves the default model on its own node; the head sends no path.

The head and Ray's processes run with different ``KVCLUSTER_CACHE`` (where the default model
lives): a head-side path would make the workers load the head's copy. The session's Ray
inherited the suite's cache dir when it started (tests/conftest.py); the head's own view is
then moved to an empty dir of the test's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.chaos_probes import on_workers
from cluster.client import KVClusterClient
from cluster.launcher import Cluster
from tests.cluster.conftest import cluster_config
from worker.model.default_model import default_model_id

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def test_workers_resolve_the_default_model_on_their_own_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ray_shared
) -> None:
    node = Path(os.environ["KVCLUSTER_CACHE"])  # what Ray's processes see
    head = tmp_path / "head-cache"
    monkeypatch.setenv("KVCLUSTER_CACHE", str(head))  # the head's own view
    cfg = cluster_config(f"default-model-{os.getpid()}", workers={"num_workers": 1})
    with Cluster(cfg) as c:
        dirs = on_workers(c, lambda w: w.model_dir)
        with KVClusterClient(c.endpoints[0]) as client:
            out = client.generate("Where is my model?", max_tokens=2, timeout=60)
        model_id, sent = c.model_id, c.model_path
    assert out.completion_tokens == 2
    assert sent is None and model_id == default_model_id("llama")
    # the worker loaded its own node's copy; the head resolved nothing
    (worker_dir,) = dirs.values()
    assert Path(worker_dir).is_relative_to(node), worker_dir
    assert Path(worker_dir).name == model_id
    assert not (head / "models").exists()
