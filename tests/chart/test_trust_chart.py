"""What the chart does for the trust model (docs/security.md): `observe`
signs in with a reader user of its own and reads replies on its own inbox
prefix; the sidecar's readiness probe on /readyz, when asked for, shows a
bridge NATS refuses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.chart.helmutil import INSTALL_HINT, K8S_VERSIONS, by_kind, env_map, render, sidecar_of, the_workload, tool, validate

pytestmark = pytest.mark.skipif(tool("helm") is None, reason=f"helm is not installed: {INSTALL_HINT}")


def _observe(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-observe")]
    return dep["spec"]["template"]["spec"]


def _secrets(pod: dict[str, Any]) -> set[str]:
    return {src["secret"]["name"] for v in pod.get("volumes", []) if "projected" in v
            for src in v["projected"]["sources"]}


def test_observe_signs_in_with_credentials_of_its_own(tmp_path: Path) -> None:
    docs = render(None, "observe.enabled=true", "bridge.nats.credsSecret.name=bridge-creds",
                  "bridge.nats.tls.enabled=true", "bridge.nats.tls.caSecret.name=nats-ca",
                  "observe.nats.credsSecret.name=observe-creds")
    pod = _observe(docs)
    env = env_map(pod["containers"][0])
    assert env["KVB_NATS_CREDS_FILE"]["value"].endswith("creds/nats.creds")
    assert env["KVB_NATS_INBOX_PREFIX"]["value"] == "_INBOX.observe"
    assert _secrets(pod) == {"observe-creds", "nats-ca"}, "its own creds and the bridges' CA, not their creds"
    proc = validate(docs, tmp_path, K8S_VERSIONS[-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_observe_user_and_password_of_its_own() -> None:
    pod = _observe(render(None, "observe.enabled=true", "bridge.nats.user=bridges",
                          "bridge.nats.passwordSecret.name=bridge-pw", "observe.nats.user=observe",
                          "observe.nats.passwordSecret.name=observe-pw"))
    env = env_map(pod["containers"][0])
    assert env["KVB_NATS_USER"]["value"] == "observe"
    assert "KVB_NATS_PASSWORD_FILE" in env
    assert _secrets(pod) == {"observe-pw"}


def test_observe_without_its_own_uses_the_bridges_access() -> None:
    pod = _observe(render(None, "observe.enabled=true", "bridge.nats.user=bridges",
                          "bridge.nats.passwordSecret.name=bridge-pw"))
    env = env_map(pod["containers"][0])
    assert env["KVB_NATS_USER"]["value"] == "bridges" and _secrets(pod) == {"bridge-pw"}


def test_sidecar_readiness_on_readyz_by_default_and_off_when_asked() -> None:
    side = sidecar_of(the_workload(render(None))["spec"]["template"]["spec"])
    assert side["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "kvb-metrics"}
    assert side["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert side["startupProbe"]["httpGet"]["path"] == "/healthz"
    off = sidecar_of(the_workload(render(None, "bridge.readinessProbe.enabled=false"))["spec"]["template"]["spec"])
    assert "readinessProbe" not in off and off["livenessProbe"]["httpGet"]["path"] == "/healthz"
