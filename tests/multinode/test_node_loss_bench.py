"""benchmarks/node_loss.py's scenario, smoke-sized, on the package's 3-node cluster (after the
other tests of the package: it kills a node, adds one, kills another)."""

from __future__ import annotations

import pytest

from benchmarks.node_loss import SMOKE, run

# pytest's 300 s per test would cut short a busy machine's slow start (the package's 3-node
# cluster starts in the first test's setup) or a wait that is far from its deadline yet
pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.timeout(900)]


def test_node_loss_benchmark_smoke(ray_nodes, cluster, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCLUSTER_RESULTS_DIR", str(tmp_path))
    result = run(ray_nodes, cluster, **SMOKE)
    f = result["figures"]
    # what it waited for happened (how long it took is the benchmark's figure, not checked
    # here: this machine may be busy): requests served, the first kill's workers left the
    # index, the new node's router served
    assert f["requests"] > 0, result
    assert f["index_purged_s_first_kill"] is not None, result
    assert f["placed_on_dead_after_purge"] is not None, result
    assert f["rejoin_serving_s"] is not None, result
    assert f["model_load_s"] > 0, result  # the workers report their model loads
    assert f["rejoin_overhead_s"] == f["rejoin_serving_s"] - f["model_load_s"], result
    assert (tmp_path / "node_loss.png").is_file()
