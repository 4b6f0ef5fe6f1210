"""deploy/prometheus/alerts.yaml: valid for ``promtool check rules``, its unit tests pass
(``promtool test rules``), every metric it names is one the code defines, and every alert has
its runbook section in docs/observability.md."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.cluster.metric_names import defined_names, metric_names

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian's prometheus package: deploy/dev.sh)"
)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    out = subprocess.run(
        [PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


@needs_promtool
def test_the_rules_fire_as_their_unit_tests_expect() -> None:
    tests = RULES.with_name("alerts_test.yaml")
    out = subprocess.run(
        [PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_read_metrics_the_code_defines(monkeypatch: pytest.MonkeyPatch) -> None:
    defined = defined_names(monkeypatch)
    missing = {(r["alert"], n) for r in rules() for n in metric_names(r["expr"]) - defined}
    assert not missing, missing


def test_every_alert_has_a_runbook_section() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    headings = {re.sub(r"[^a-z0-9]", "", h.lower()) for h in re.findall(r"^### (.+)$", doc, re.M)}
    for r in rules():
        anchor = r["annotations"]["runbook"].split("#", 1)[1]
        assert anchor == r["alert"].lower() and anchor in headings, r["alert"]
