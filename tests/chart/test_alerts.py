"""The chart's PrometheusRule: valid for promtool, each alert fires on its
synthetic series and stays quiet on a healthy one (tests/chart/alerts/), every
alert has its runbook line in the docs, and every metric it reads is one the
bridge or observe exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.chart.helmutil import CRD_KINDS, INSTALL_HINT, REPO, by_kind, render, tool

PROMTOOL = shutil.which("promtool")
pytestmark = [
    pytest.mark.skipif(tool("helm") is None, reason=f"helm is not installed: {INSTALL_HINT}"),
    pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH: `apt-get install -y prometheus` "
                       "(.ci/run does it in CI; requirements/apt.txt has the version)"),
]

UNIT_TESTS = Path(__file__).parent / "alerts" / "alerts.test.yaml"
ON = ("prometheusRule.enabled=true", "observe.enabled=true")


def _groups() -> list[dict[str, Any]]:
    (rule,) = by_kind(render(None, *ON), "PrometheusRule")
    return rule["spec"]["groups"]


def _alerts() -> list[dict[str, Any]]:
    return [r for g in _groups() for r in g["rules"]]


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def _rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(json.dumps({"groups": _groups()}))  # JSON is YAML
    return path


def test_the_rule_is_off_by_default_and_a_crd() -> None:
    assert not by_kind(render(None), "PrometheusRule")
    assert "PrometheusRule" in CRD_KINDS


def test_promtool_checks_the_rendered_rules(tmp_path: Path) -> None:
    proc = _promtool("check", "rules", str(_rules_file(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in proc.stdout, proc.stdout


def test_each_alert_fires_on_its_condition_and_only_then(tmp_path: Path) -> None:
    _rules_file(tmp_path)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    proc = _promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text()))
    assert tested == {a["alert"] for a in _alerts()}, "every alert has a unit test"


def test_every_alert_has_its_runbook_line() -> None:
    docs = (REPO / "docs" / "kubernetes.md").read_text()
    for alert in _alerts():
        anchor = alert["annotations"]["runbook"].split("#", 1)[1]
        assert anchor == alert["alert"].lower()
        assert re.search(rf"^#+ `?{alert['alert']}`?\s*$", docs, re.M), f"{alert['alert']}: no runbook in docs/kubernetes.md"


def test_every_metric_an_alert_reads_is_exported() -> None:
    from prometheus_client import generate_latest

    from bridge.producer.telemetry.metrics import Metrics

    bridge_body = generate_latest(Metrics().registry).decode()
    fleet_source = (REPO / "bridge" / "apps" / "fleet" / "metrics.py").read_text()
    for alert in _alerts():
        for name in re.findall(r"\b(kvbridge_\w+|kvobserve_\w+)", alert["expr"]):
            if name.startswith("kvbridge_"):
                assert re.search(rf"^(# TYPE )?{name}\b", bridge_body, re.M), f"{alert['alert']}: {name} not exported"
            else:
                family = name.removesuffix("_total")
                assert f'"{family}"' in fleet_source, f"{alert['alert']}: {name} not exported by observe"
