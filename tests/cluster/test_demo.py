"""``kvcluster demo`` on the default model (SmolLM2-135M-Instruct): readable answers, and the
shared system prompts hit the workers' prefix caches."""

from __future__ import annotations

import json

import pytest

from cluster.demo import QUESTIONS, run_demo
from tests.cluster.conftest import cluster_config

pytestmark = [pytest.mark.ray, pytest.mark.redis]


def test_demo_answers_in_english_with_prefix_hits(capsys, ray_shared) -> None:
    cfg = cluster_config("demo-test", model={"tiny_family": None})
    assert run_demo(cfg, num_requests=4, max_tokens=24) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out
    lines = out.splitlines()
    asked = next(i for i, line in enumerate(lines) if line.endswith(QUESTIONS[0]))
    assert "Paris" in lines[asked + 1], out  # the greedy answer to the capital of France
    summary = json.loads(lines[-1])["demo"]
    assert summary["requests"] == 4 and summary["warm_prefix_hit_rate"] > 0.3, summary
