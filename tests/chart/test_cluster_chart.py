"""The charts on a NATS cluster: the umbrella's three-server JetStream values
(values-cluster.yaml) with an R3 stream, and the kv-bridge chart's per-pod
credentials (each pod its own NATS user, docs/security.md "Least privilege").

Needs helm: `bash scripts/install-chart-tools.sh`. With KVB_NATS_CHART set to
an unpacked official NATS chart (1.x), the umbrella is also rendered with it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.chart.helmutil import (
    CHART,
    CI_VALUES,
    INSTALL_HINT,
    NAMESPACE,
    RELEASE,
    STACK,
    by_kind,
    env_map,
    helm,
    load_all,
    render,
    sidecar_of,
    sidecar_patch,
    the_workload,
    tool,
    vllm_of,
    workload,
)

pytestmark = pytest.mark.skipif(tool("helm") is None, reason=f"helm is not installed: {INSTALL_HINT}")

CLUSTER = next(p for p in CI_VALUES if p.name == "cluster-values.yaml")
CLUSTER_STACK = STACK / "values-cluster.yaml"
POD_CREDS = "/etc/kv-bridge/pod/nats.creds"


def _pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    found = workload(docs)
    assert found is not None
    return found["spec"]["template"]["spec"]


def test_each_pod_mounts_only_its_own_credentials() -> None:
    docs = render(CLUSTER)
    assert the_workload(docs)["kind"] == "StatefulSet"
    spec = _pod_spec(docs)
    side = sidecar_of(spec)
    env = env_map(side)
    assert env["KVB_NATS_CREDS_FILE"]["value"] == POD_CREDS
    # $(POD_NAME) in subPathExpr is the container's own variable: defined, from the pod's name
    names = [e["name"] for e in side["env"]]
    assert names[0] == "POD_NAME" and env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["KVB_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (mount,) = [m for m in side["volumeMounts"] if m["name"] == "kv-bridge-nats-pod-creds"]
    assert mount == {"name": "kv-bridge-nats-pod-creds", "mountPath": POD_CREDS, "subPathExpr": "$(POD_NAME).creds",
                     "readOnly": True}
    (volume,) = [v for v in spec["volumes"] if v["name"] == "kv-bridge-nats-pod-creds"]
    assert volume["secret"]["secretName"] == "kv-bridge-nats-pod-creds"
    # vLLM sees none of it, and no shared credentials are configured
    assert "kv-bridge-nats-pod-creds" not in [m["name"] for m in vllm_of(spec).get("volumeMounts", [])]
    assert "kv-bridge-nats-secrets" not in [v["name"] for v in spec["volumes"]]


def test_the_cluster_values_give_every_url_and_three_replicas() -> None:
    env = env_map(sidecar_of(_pod_spec(render(CLUSTER))))
    urls = env["KVB_NATS_URL"]["value"].split(",")
    assert len(urls) == 3 and all(u.startswith("nats://nats-") for u in urls)
    assert env["KVB_JETSTREAM"]["value"] == "true"
    assert env["KVB_STREAM_REPLICAS"]["value"] == "3"


def test_per_pod_credentials_refuse_settings_that_cannot_work() -> None:
    deployment = helm("template", RELEASE, str(CHART), "-f", str(CLUSTER), "--set", "vllm.kind=Deployment",
                      check=False)
    assert deployment.returncode != 0 and "needs vllm.kind StatefulSet" in deployment.stderr
    both = helm("template", RELEASE, str(CHART), "-f", str(CLUSTER), "--set", "bridge.nats.credsSecret.name=shared",
                check=False)
    assert both.returncode != 0 and "exclude each other" in both.stderr
    bad_key = helm("template", RELEASE, str(CHART), "-f", str(CLUSTER),
                   "--set", "bridge.nats.credsPerPod.keySuffix=a/b", check=False)
    assert bad_key.returncode != 0


def test_per_pod_credentials_in_the_sidecar_patch() -> None:
    """Sidecar mode: your StatefulSet gets the same volume and mount."""
    docs = render(None, "mode=sidecar", "bridge.nats.credsPerPod.secretName=pod-creds")
    patch = load_all(sidecar_patch(docs)["data"]["sidecar-patch.yaml"])[0]
    spec = patch["spec"]["template"]["spec"]
    side = sidecar_of(spec)
    assert env_map(side)["KVB_NATS_CREDS_FILE"]["value"] == POD_CREDS
    assert any(m.get("subPathExpr") == "$(POD_NAME).creds" for m in side["volumeMounts"])
    assert any(v.get("secret", {}).get("secretName") == "pod-creds" for v in spec["volumes"])


def _offline_stack(tmp_path: Path) -> Path:
    """The umbrella without the NATS dependency (it needs the network), with
    kv-bridge from this tree; or with the NATS chart from KVB_NATS_CHART."""
    stack = tmp_path / "stack"
    shutil.copytree(STACK, stack)
    chart = load_all((stack / "Chart.yaml").read_text())[0]
    nats_chart = os.environ.get("KVB_NATS_CHART")
    deps = []
    for dep in chart["dependencies"]:
        if dep["name"] == "kv-bridge":
            deps.append({**dep, "repository": f"file://{CHART}"})
        elif nats_chart:
            version = load_all((Path(nats_chart) / "Chart.yaml").read_text())[0]["version"]
            deps.append({**dep, "repository": f"file://{nats_chart}", "version": version})
    chart["dependencies"] = deps
    (stack / "Chart.yaml").write_text(json.dumps(chart))
    helm("dependency", "build", str(stack))
    return stack


def test_the_stack_cluster_values_make_an_r3_bridge_on_three_servers(tmp_path: Path) -> None:
    stack = _offline_stack(tmp_path)
    docs = load_all(helm("template", "demo", str(stack), "--namespace", NAMESPACE, "-f", str(CLUSTER_STACK)).stdout)
    found = workload([d for d in docs if d.get("kind") in ("Deployment", "StatefulSet")
                      and any(c["name"] == "kv-bridge" for c in d["spec"]["template"]["spec"].get("initContainers", []))])
    assert found is not None and found["kind"] == "StatefulSet"
    env = env_map(sidecar_of(found["spec"]["template"]["spec"]))
    assert env["KVB_NATS_URL"]["value"] == ",".join(
        f"nats://demo-nats-{i}.demo-nats-headless:4222" for i in range(3))
    assert env["KVB_JETSTREAM"]["value"] == "true" and env["KVB_STREAM_REPLICAS"]["value"] == "3"
    values = load_all(CLUSTER_STACK.read_text())[0]["nats"]
    assert values["config"]["cluster"] == {"enabled": True, "replicas": 3}
    assert values["config"]["jetstream"]["enabled"] is True
    assert values["config"]["jetstream"]["fileStore"]["pvc"]["size"]
    if os.environ.get("KVB_NATS_CHART"):
        (servers,) = [d for d in by_kind(docs, "StatefulSet") if d["metadata"]["name"] == "demo-nats"]
        assert servers["spec"]["replicas"] == 3
        (config,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "demo-nats-config"]
        text = config["data"]["nats.conf"]
        assert "jetstream" in text and "routes" in text and "demo-nats-2.demo-nats-headless" in text
        assert any(s["metadata"]["name"] == "demo-nats-headless" for s in by_kind(docs, "Service"))


def test_a_release_named_like_nats_keeps_its_urls(tmp_path: Path) -> None:
    stack = _offline_stack(tmp_path)
    docs = load_all(helm("template", "my-nats", str(stack), "--namespace", NAMESPACE, "-f",
                         str(CLUSTER_STACK)).stdout)
    found = [d for d in docs if d.get("kind") == "StatefulSet"
             and any(c["name"] == "kv-bridge" for c in d["spec"]["template"]["spec"].get("initContainers", []))]
    env = env_map(sidecar_of(found[0]["spec"]["template"]["spec"]))
    assert env["KVB_NATS_URL"]["value"].split(",")[0] == "nats://my-nats-0.my-nats-headless:4222"
