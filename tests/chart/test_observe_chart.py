"""The chart's optional `observe` Deployment, its Service, PodMonitor and the
fleet dashboard: off by default, valid when on, wired to the bridges' NATS."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.chart.helmutil import (
    CHART,
    INSTALL_HINT,
    K8S_VERSIONS,
    NAMESPACE,
    by_kind,
    env_map,
    helm,
    render,
    tool,
    validate,
)

pytestmark = pytest.mark.skipif(tool("helm") is None, reason=f"helm is not installed: {INSTALL_HINT}")

ON = ("observe.enabled=true",)


def _observe(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith("-observe")]
    return doc


def test_observe_is_off_by_default() -> None:
    docs = render(None)
    assert not [d for d in docs if d["metadata"]["name"].endswith(("-observe", "-fleet-grafana"))]


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_observe_renders_and_validates(k8s_version: str, tmp_path: Path) -> None:
    docs = render(None, *ON, "podMonitor.labels.release=prometheus")
    proc = validate(docs, tmp_path, k8s_version)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = helm("lint", "--strict", str(CHART), "--set", ON[0])
    assert "0 chart(s) failed" in out.stdout


def test_observe_deployment_service_and_podmonitor_agree() -> None:
    docs = render(None, *ON, "observe.httpPort=9500", "podMonitor.labels.release=prometheus")
    dep, svc, pm = (_observe(docs, k) for k in ("Deployment", "Service", "PodMonitor"))
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert labels["app.kubernetes.io/component"] == "observe"
    (c,) = pod["spec"]["containers"]
    assert c["args"][0] == "observe" and c["args"][c["args"].index("--http-port") + 1] == "9500"
    assert c["ports"][0]["containerPort"] == 9500 and svc["spec"]["ports"][0]["port"] == 9500
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert pm["metadata"]["labels"]["release"] == "prometheus"
    assert pm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_observe_uses_the_bridges_nats_access() -> None:
    docs = render(None, *ON, "bridge.nats.url=nats://bus:4222", "bridge.nats.credsSecret.name=kv-creds",
                  "bridge.subjectPrefix=kvx")
    (c,) = _observe(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = env_map(c)
    assert env["KVB_NATS_URL"]["value"] == "nats://bus:4222"
    assert env["KVB_SUBJECT_PREFIX"]["value"] == "kvx"
    creds = [e for e in env.values() if e.get("value", "").startswith("/etc/kv-bridge/nats/")]
    assert creds, env
    mounts = {m["name"] for m in c["volumeMounts"]}
    assert "kv-bridge-nats-secrets" in mounts
    assert "kv-creds" in json.dumps(docs)


def test_observe_podmonitor_can_be_off_and_schema_checks_keys() -> None:
    docs = render(None, *ON, "observe.podMonitor.enabled=false")
    assert not [d for d in by_kind(docs, "PodMonitor") if d["metadata"]["name"].endswith("-observe")]
    bad = helm("template", "kvb", str(CHART), "--set", "observe.nope=1", check=False)
    assert bad.returncode != 0 and "nope" in bad.stderr


def test_fleet_dashboard_configmap() -> None:
    docs = render(None, *ON)
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-fleet-grafana")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["kv-bridge-fleet.json"])
    assert dash["uid"] == "kv-bridge-fleet"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    names = set(re.findall(r"\b(kvobserve_[a-z_]+)", exprs))
    for needed in ("kvobserve_resident_blocks", "kvobserve_fleet_shared_hashes", "kvobserve_hybrid_resumable_ratio",
                   "kvobserve_staleness_seconds", "kvobserve_stored_blocks_total", "kvobserve_gaps_total"):
        assert needed in names
    assert not [d for d in by_kind(render(None, *ON, "dashboard.enabled=false"), "ConfigMap")
                if d["metadata"]["name"].endswith("-fleet-grafana")]
