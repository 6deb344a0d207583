"""The Helm chart in helm/kv-bridge: lint, render, validate, and what the
rendered objects promise (native sidecar, probes, env/args, secrets by reference).

Needs helm and kubernetes-validate: `bash scripts/install-chart-tools.sh`.
Skipped, with that hint, only when helm is not installed at all.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.chart.helmutil import (
    CHART,
    CI_VALUES,
    CRD_KINDS,
    INSTALL_HINT,
    K8S_VERSIONS,
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
    validate,
    vllm_of,
    workload,
)

pytestmark = pytest.mark.skipif(tool("helm") is None, reason=f"helm is not installed: {INSTALL_HINT}")

CI = {p.stem.removesuffix("-values"): p for p in CI_VALUES}
WORKLOAD_FILES = [p for p in CI_VALUES if "sidecar" not in p.name]
SECRET_MOUNT = "/etc/kv-bridge/nats"
ids = [p.name for p in CI_VALUES]


def test_ci_values_files_cover_the_modes() -> None:
    assert {"defaults", "sidecar", "tls", "jetstream"} <= set(CI), sorted(CI)


def test_chart_has_no_hard_dependencies() -> None:
    """helm template/install must work offline, without `helm dependency build`:
    helm refuses to render a chart with a declared but missing dependency even
    when its condition is false, so the NATS chart lives in the umbrella chart."""
    chart = load_all((CHART / "Chart.yaml").read_text())[0]
    assert not chart.get("dependencies")
    assert chart["apiVersion"] == "v2"
    assert chart["kubeVersion"].startswith(">=1.29")


# --- lint, render, validate -----------------------------------------------------------

@pytest.mark.parametrize("values", CI_VALUES, ids=ids)
def test_helm_lint_strict(values: Path) -> None:
    out = helm("lint", "--strict", str(CHART), "-f", str(values))
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("values", CI_VALUES, ids=ids)
def test_rendering_validates_strict(values: Path, k8s_version: str, tmp_path: Path) -> None:
    docs = render(values)
    assert docs
    proc = validate(docs, tmp_path, k8s_version)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Couldn't find schema" not in proc.stdout + proc.stderr
    for doc in docs:
        assert doc["metadata"]["name"]
        assert len(doc["metadata"]["name"]) <= 63


@pytest.mark.parametrize("values", CI_VALUES, ids=ids)
def test_every_object_is_labelled(values: Path) -> None:
    for doc in render(values):
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_default_rendering_objects() -> None:
    kinds = sorted(d["kind"] for d in render(CI["defaults"]))
    assert kinds == ["ConfigMap", "Deployment", "Service"]


# --- the sidecar ---------------------------------------------------------------------

@pytest.mark.parametrize("values", WORKLOAD_FILES, ids=[p.name for p in WORKLOAD_FILES])
def test_sidecar_is_a_native_sidecar(values: Path) -> None:
    spec = the_workload(render(values))["spec"]["template"]["spec"]
    side = sidecar_of(spec)
    assert side["restartPolicy"] == "Always"
    assert "kv-bridge" not in [c["name"] for c in spec["containers"]]
    assert side["args"][0] == "run"


@pytest.mark.parametrize("values", WORKLOAD_FILES, ids=[p.name for p in WORKLOAD_FILES])
def test_sidecar_probes_never_restart_it_for_nats(values: Path) -> None:
    """Readiness is /readyz, so a bridge NATS refuses shows NotReady; the
    liveness/startup probes hit /healthz (the bridge's own loop), never /readyz:
    a NATS outage is no reason to restart the sidecar or delay vLLM's start."""
    side = sidecar_of(the_workload(render(values))["spec"]["template"]["spec"])
    assert side["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "kvb-metrics"}
    for name in ("startupProbe", "livenessProbe"):
        probe = side[name]
        assert probe["httpGet"]["path"] == "/healthz", name
        assert probe["httpGet"]["port"] == "kvb-metrics"
    startup = side["startupProbe"]
    assert startup["periodSeconds"] <= 2, "vLLM waits for the sidecar's startup probe: keep it fast"
    assert startup.get("initialDelaySeconds", 0) == 0
    assert startup["periodSeconds"] * startup["failureThreshold"] <= 60
    assert json.dumps({k: v for k, v in side.items() if k != "readinessProbe"}).count("/readyz") == 0


@pytest.mark.parametrize("values", WORKLOAD_FILES, ids=[p.name for p in WORKLOAD_FILES])
def test_sidecar_security_context(values: Path) -> None:
    spec = the_workload(render(values))["spec"]["template"]["spec"]
    side = sidecar_of(spec)
    sc = side["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 10001
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    mounts = {m["mountPath"]: m["name"] for m in side["volumeMounts"]}
    tmp = next(v for v in spec["volumes"] if v["name"] == mounts["/tmp"])
    assert "emptyDir" in tmp
    assert side["resources"]["limits"]["memory"]


@pytest.mark.parametrize("values", WORKLOAD_FILES, ids=[p.name for p in WORKLOAD_FILES])
def test_worker_id_from_downward_api(values: Path) -> None:
    spec = the_workload(render(values))["spec"]["template"]["spec"]
    env = env_map(sidecar_of(spec))
    for name in ("POD_NAME", "KVB_WORKER_ID"):
        assert env[name]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", name


@pytest.mark.parametrize("values", WORKLOAD_FILES, ids=[p.name for p in WORKLOAD_FILES])
def test_vllm_kv_events_wired_to_the_sidecar(values: Path) -> None:
    spec = the_workload(render(values))["spec"]["template"]["spec"]
    env = env_map(sidecar_of(spec))
    args = vllm_of(spec)["args"]
    cfg = json.loads(args[args.index("--kv-events-config") + 1])
    assert cfg["enable_kv_cache_events"] is True
    assert cfg["publisher"] == "zmq"
    if "KVB_VLLM_URL" in env:
        # the sidecar reads the publishers from vLLM's own HTTP server, on the pod's loopback
        port = vllm_of(spec)["args"][vllm_of(spec)["args"].index("--port") + 1]
        assert env["KVB_VLLM_URL"]["value"] == f"http://127.0.0.1:{port}"
        assert not {"KVB_ZMQ_ENDPOINT", "KVB_REPLAY_ENDPOINT", "KVB_TOPIC", "KVB_DP_RANKS"} & env.keys()
        return
    # vLLM binds only wildcard endpoints; the sidecar connects over localhost.
    pub_port = int(cfg["endpoint"].removeprefix("tcp://*:"))
    assert env["KVB_ZMQ_ENDPOINT"]["value"] == f"tcp://127.0.0.1:{pub_port}"
    replay_port = int(cfg["replay_endpoint"].removeprefix("tcp://*:"))
    assert env["KVB_REPLAY_ENDPOINT"]["value"] == f"tcp://127.0.0.1:{replay_port}"
    assert env["KVB_TOPIC"]["value"] == cfg["topic"]


def test_the_sidecar_reads_vllms_publishers_by_default() -> None:
    spec = the_workload(render(None))["spec"]["template"]["spec"]
    env = env_map(sidecar_of(spec))
    assert env["KVB_VLLM_URL"]["value"] == "http://127.0.0.1:8000"
    spec = the_workload(render(None, "vllm.port=8080"))["spec"]["template"]["spec"]
    assert env_map(sidecar_of(spec))["KVB_VLLM_URL"]["value"] == "http://127.0.0.1:8080"
    spec = the_workload(render(None, "bridge.vllmUrl=http://10.0.0.5:9000"))["spec"]["template"]["spec"]
    assert env_map(sidecar_of(spec))["KVB_VLLM_URL"]["value"] == "http://10.0.0.5:9000"
    spec = the_workload(render(None, "bridge.vllmUrl="))["spec"]["template"]["spec"]
    env = env_map(sidecar_of(spec))
    assert "KVB_VLLM_URL" not in env and env["KVB_ZMQ_ENDPOINT"]["value"] == "tcp://127.0.0.1:5557"


def test_replay_can_be_disabled() -> None:
    spec = the_workload(render(None, "kvEvents.replayPort=0", "bridge.vllmUrl="))["spec"]["template"]["spec"]
    args = vllm_of(spec)["args"]
    assert "replay_endpoint" not in json.loads(args[args.index("--kv-events-config") + 1])
    assert "KVB_REPLAY_ENDPOINT" not in env_map(sidecar_of(spec))


def test_env_and_args_reach_the_sidecar() -> None:
    spec = the_workload(render(CI["jetstream"]))["spec"]["template"]["spec"]
    side = sidecar_of(spec)
    assert side["args"] == ["run", "--heartbeat-interval", "2"]
    env = {k: v.get("value") for k, v in env_map(side).items()}
    expected = {
        "KVB_JETSTREAM": "true",
        "KVB_STREAM_NAME": "KV_EVENTS_PROD",
        "KVB_STREAM_MAX_AGE": "7200",
        "KVB_STREAM_MAX_BYTES": "4294967296",
        "KVB_STREAM_MAX_MSGS_PER_SUBJECT": "200000",
        "KVB_STREAM_DUPLICATE_WINDOW": "300",
        "KVB_STREAM_REPLICAS": "3",
        "KVB_JS_MAX_PENDING": "4096",
        "KVB_JS_MAX_PENDING_BYTES": "33554432",
        "KVB_JS_ACK_TIMEOUT": "2.5",
        "KVB_COALESCE_MS": "1",
        "KVB_DP_RANKS": "2",
        "KVB_FORMAT": "json",
        "KVB_KEEP_PLACEHOLDERS": "true",
        "KVB_MAX_BUFFERED_BATCHES": "50000",
        "KVB_MAX_BUFFERED_BYTES": "536870912",
        "KVB_REPLAY_TIMEOUT": "3.5",
        "KVB_DRAIN_TIMEOUT": "20",
        "KVB_HTTP_PORT": "9400",
        "KVB_SUBJECT_PREFIX": "kv",
        "KVB_REGISTRY_BUCKET": "kv_workers_prod",  # extraEnv
    }
    assert {k: env.get(k) for k in expected} == expected
    assert all(k.startswith(("KVB_", "POD_")) for k in env), sorted(env)
    # Numbers must not come out in scientific notation.
    assert not any(re.search(r"\de[+-]?\d", v or "") for v in env.values())
    # vLLM side: data parallelism, extra kv-events keys, GPU count, extra args.
    vllm = vllm_of(spec)
    args = vllm["args"]
    assert args[args.index("--data-parallel-size") + 1] == "2"
    assert json.loads(args[args.index("--kv-events-config") + 1])["buffer_steps"] == 20000
    assert args[-2:] == ["--tensor-parallel-size", "1"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert spec["terminationGracePeriodSeconds"] == 90


def test_group_kinds_and_extra_env_in_sidecar_mode() -> None:
    side = sidecar_of(load_all(sidecar_patch(render(CI["sidecar"]))["data"]["sidecar-patch.yaml"])[0]
                      ["spec"]["template"]["spec"])
    env = env_map(side)
    assert env["KVB_GROUP_KIND"]["value"] == "1=mamba,2=sliding_window"
    assert env["KVB_ZMQ_RCVHWM"]["value"] == "200000"
    assert env["KVB_LOG_LEVEL"]["value"] == "debug"
    assert side["args"] == ["run", "--max-buffered-batches", "20000"]
    assert side["image"] == "registry.example.com/ml/kv-bridge:0.1.0"


def test_gpu_and_model_from_values() -> None:
    spec = the_workload(render(CI["defaults"]))["spec"]["template"]["spec"]
    vllm = vllm_of(spec)
    assert vllm["command"] == ["vllm", "serve"]
    assert vllm["args"][0] == "Qwen/Qwen3-0.6B"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"
    shm = next(m for m in vllm["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in spec["volumes"] if v["name"] == shm["name"])["emptyDir"]["medium"] == "Memory"
    assert "--data-parallel-size" not in vllm["args"]


def test_image_tag_defaults_to_app_version_and_digest_wins() -> None:
    chart = load_all((CHART / "Chart.yaml").read_text())[0]
    side = sidecar_of(the_workload(render(CI["defaults"]))["spec"]["template"]["spec"])
    assert side["image"] == f"kv-bridge:{chart['appVersion']}"
    side = sidecar_of(the_workload(render(CI["tls"]))["spec"]["template"]["spec"])
    assert re.fullmatch(r"registry\.example\.com/ml/kv-bridge@sha256:[0-9a-f]{64}", side["image"])


def test_statefulset_mode() -> None:
    docs = render(CI["tls"])
    sts = the_workload(docs)
    assert sts["kind"] == "StatefulSet"
    assert sts["spec"]["replicas"] == 2
    headless = [s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"]
    assert [s["metadata"]["name"] for s in headless] == [sts["spec"]["serviceName"]]
    env = env_map(vllm_of(sts["spec"]["template"]["spec"]))
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}


# --- secrets ---------------------------------------------------------------------------

def _secret_sources(spec: dict[str, Any]) -> dict[tuple[str, str], str]:
    vol = next(v for v in spec["volumes"] if v["name"] == "kv-bridge-nats-secrets")
    out = {}
    for src in vol["projected"]["sources"]:
        for item in src["secret"]["items"]:
            out[(src["secret"]["name"], item["key"])] = item["path"]
    return out


def _assert_no_inlined_secrets(docs: list[dict[str, Any]]) -> None:
    assert not by_kind(docs, "Secret"), "the chart references Secrets, it never creates them"
    for doc in docs:
        text = json.dumps(doc)
        for name in ("KVB_NATS_PASSWORD", "KVB_NATS_TOKEN"):
            assert f'"name": "{name}", "value"' not in text, f"{name} inlined in {doc['kind']}"


def test_tls_and_creds_come_from_mounted_secrets() -> None:
    docs = render(CI["tls"])
    _assert_no_inlined_secrets(docs)
    spec = the_workload(docs)["spec"]["template"]["spec"]
    side = sidecar_of(spec)
    env = env_map(side)
    assert env["KVB_NATS_URL"]["value"].startswith("tls://")
    assert _secret_sources(spec) == {
        ("kv-bridge-nats-creds", "kv-bridge.creds"): "creds/nats.creds",
        ("nats-ca", "ca.crt"): "tls/ca.crt",
        ("kv-bridge-nats-client-tls", "tls.crt"): "tls/tls.crt",
        ("kv-bridge-nats-client-tls", "tls.key"): "tls/tls.key",
    }
    assert env["KVB_NATS_CREDS_FILE"]["value"] == f"{SECRET_MOUNT}/creds/nats.creds"
    assert env["KVB_NATS_TLS_CA"]["value"] == f"{SECRET_MOUNT}/tls/ca.crt"
    assert env["KVB_NATS_TLS_CERT"]["value"] == f"{SECRET_MOUNT}/tls/tls.crt"
    assert env["KVB_NATS_TLS_KEY"]["value"] == f"{SECRET_MOUNT}/tls/tls.key"
    mount = next(m for m in side["volumeMounts"] if m["name"] == "kv-bridge-nats-secrets")
    assert mount == {"name": "kv-bridge-nats-secrets", "mountPath": SECRET_MOUNT, "readOnly": True}
    # Only the sidecar sees the NATS secrets.
    for c in spec["containers"]:
        assert "kv-bridge-nats-secrets" not in [m["name"] for m in c.get("volumeMounts", [])]


def test_url_and_token_from_secrets() -> None:
    docs = render(CI["jetstream"])
    _assert_no_inlined_secrets(docs)
    spec = the_workload(docs)["spec"]["template"]["spec"]
    env = env_map(sidecar_of(spec))
    assert env["KVB_NATS_URL"] == {
        "name": "KVB_NATS_URL", "valueFrom": {"secretKeyRef": {"name": "kv-bridge-nats", "key": "url"}},
    }
    assert env["KVB_NATS_TOKEN_FILE"]["value"] == f"{SECRET_MOUNT}/token/token"
    assert _secret_sources(spec) == {("kv-bridge-nats", "token"): "token/token"}


def test_no_secret_volume_without_secrets() -> None:
    spec = the_workload(render(CI["defaults"]))["spec"]["template"]["spec"]
    assert "kv-bridge-nats-secrets" not in [v["name"] for v in spec["volumes"]]
    env = env_map(sidecar_of(spec))
    assert env["KVB_NATS_URL"]["value"] == "nats://nats:4222"
    assert not [k for k in env if k.endswith("_FILE") or k.startswith("KVB_NATS_TLS")]


def test_values_cannot_inline_secrets() -> None:
    """The schema has no place for a password or token value."""
    for s in ("bridge.nats.password=hunter2", "bridge.nats.token=abc", "bridge.nats.tls.key=x"):
        proc = helm("template", RELEASE, str(CHART), "--set", s, check=False)
        assert proc.returncode != 0, s
        assert "additional properties" in proc.stderr, proc.stderr


def test_schema_rejects_unknown_keys() -> None:
    proc = helm("template", RELEASE, str(CHART), "--set", "bridge.natsUrl=nats://x:4222", check=False)
    assert proc.returncode != 0
    assert "additional properties 'natsUrl' not allowed" in proc.stderr


def test_nats_url_is_required() -> None:
    proc = helm("template", RELEASE, str(CHART), "--set", "bridge.nats.url=", check=False)
    assert proc.returncode != 0
    assert "bridge.nats.url" in proc.stderr and "embedded nats-server" in proc.stderr


def test_nats_url_goes_through_tpl() -> None:
    spec = the_workload(render(None, "bridge.nats.url=nats://{{ .Release.Name }}-nats:4222"))["spec"]["template"]["spec"]
    assert env_map(sidecar_of(spec))["KVB_NATS_URL"]["value"] == f"nats://{RELEASE}-nats:4222"


# --- sidecar-only mode -------------------------------------------------------------------

SAMPLE_VLLM = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "my-vllm", "namespace": NAMESPACE},
    "spec": {
        "selector": {"matchLabels": {"app": "my-vllm"}},
        "template": {
            "metadata": {"labels": {"app": "my-vllm"}},
            "spec": {
                "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0",
                                "args": ["Qwen/Qwen3-0.6B"]}],
                "volumes": [{"name": "cache", "emptyDir": {}}],
            },
        },
    },
}


def _strategic_merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Enough of a strategic merge for this patch: maps merge, lists of named
    items merge by name (initContainers, volumes, imagePullSecrets)."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _strategic_merge(out[key], value)
        elif isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
            merged = {v["name"]: v for v in out.get(key, [])}
            merged.update({v["name"]: v for v in value})
            out[key] = list(merged.values())
        else:
            out[key] = copy.deepcopy(value)
    return out


def _json_patch_add(target: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    out = copy.deepcopy(target)
    for op in ops:
        assert op["op"] == "add"
        *parents, last = op["path"].lstrip("/").split("/")
        node: Any = out
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        assert last == "-" and isinstance(node, list)
        node.append(op["value"])
    return out


def test_sidecar_mode_renders_only_the_patch_and_monitoring() -> None:
    docs = render(CI["sidecar"])
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "ConfigMap", "PodMonitor"]
    assert workload(docs) is None


def test_sidecar_patch_applies_and_validates(tmp_path: Path) -> None:
    docs = render(CI["sidecar"])
    data = sidecar_patch(docs)["data"]
    patch = load_all(data["sidecar-patch.yaml"])[0]
    patched = _strategic_merge(SAMPLE_VLLM, patch)
    patched = _json_patch_add(patched, json.loads(data["vllm-args-patch.json"]))
    spec = patched["spec"]["template"]["spec"]
    side = sidecar_of(spec)
    assert side["restartPolicy"] == "Always"
    assert side["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert [v["name"] for v in spec["volumes"]][:1] == ["cache"], "existing volumes are kept"
    vllm_args = vllm_of(spec)["args"]
    assert vllm_args[-2] == "--kv-events-config"
    assert vllm_args[-1] == data["kv-events-config.json"]
    cfg = json.loads(vllm_args[-1])
    assert cfg["endpoint"] == "tcp://*:6557" and cfg["replay_endpoint"] == "tcp://*:6558"
    env = env_map(side)
    assert env["KVB_ZMQ_ENDPOINT"]["value"] == "tcp://127.0.0.1:6557"
    assert env["KVB_TOPIC"]["value"] == cfg["topic"] == "kv-prod"
    assert env["KVB_NATS_PASSWORD_FILE"]["value"] == f"{SECRET_MOUNT}/password/password"
    assert _secret_sources(spec) == {("kv-bridge-nats-password", "password"): "password/password"}
    assert spec["imagePullSecrets"] == [{"name": "registry-creds"}]
    for version in K8S_VERSIONS:
        proc = validate([patched], tmp_path, version)
        assert proc.returncode == 0, proc.stdout + proc.stderr


# --- monitoring --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["jetstream", "sidecar"])
def test_podmonitor_selects_the_sidecar_pods(name: str) -> None:
    docs = render(CI[name])
    (pm,) = by_kind(docs, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    if name == "jetstream":
        pod = the_workload(docs)["spec"]["template"]
    else:
        pod = load_all(sidecar_patch(docs)["data"]["sidecar-patch.yaml"])[0]["spec"]["template"]
    selector = pm["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    ports = [p["name"] for p in sidecar_of(pod["spec"])["ports"]]
    assert endpoint["port"] in ports
    assert pm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    if name == "sidecar":
        assert pm["metadata"]["labels"]["release"] == "prometheus"
    assert set(CRD_KINDS) == {"PodMonitor", "PrometheusRule"}


def _dashboard(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    return json.loads(cm["data"]["kv-bridge.json"])


def _dashboard_metrics(dash: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs
    return set(re.findall(r"\b(kvbridge_[a-z_]+)", " ".join(exprs)))


def test_dashboard_configmap() -> None:
    dash = _dashboard(render(CI["defaults"]))
    assert dash["uid"] == "kv-bridge"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    names = _dashboard_metrics(dash)
    for needed in ("kvbridge_batches_in_total", "kvbridge_events_out_total", "kvbridge_dropped_total",
                   "kvbridge_malformed_total", "kvbridge_gaps_total", "kvbridge_replays_total",
                   "kvbridge_restarts_total", "kvbridge_queue_depth", "kvbridge_nats_reconnects_total",
                   "kvbridge_lag_seconds_bucket", "kvbridge_nats_connected"):
        assert needed in names
    assert not by_kind(render(None, "dashboard.enabled=false"), "ConfigMap")


def test_dashboard_metrics_exist_in_the_bridge() -> None:
    """Every metric the dashboard queries is one the bridge exports."""
    metrics_mod = pytest.importorskip("bridge.producer.telemetry.metrics")
    registry = metrics_mod.Metrics().registry
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    exported = set()
    for family in registry.collect():  # labelled families without children have no samples yet
        exported.add(family.name)
        exported.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
    missing = _dashboard_metrics(_dashboard(render(CI["defaults"]))) - exported
    assert not missing, f"dashboard queries metrics the bridge does not export: {sorted(missing)}"


# --- NOTES ---------------------------------------------------------------------------------

@pytest.mark.parametrize("values", CI_VALUES, ids=ids)
def test_notes_tell_how_to_watch_events(values: Path) -> None:
    out = helm("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE, "-f", str(values)).stdout
    notes = out[out.index("NOTES:"):]
    assert "kv-bridge tail" in notes
    assert "nats sub 'kv.>'" in notes
    assert "/healthz" in notes
    if "sidecar" in values.name:
        assert "--type strategic --patch-file sidecar-patch.yaml" in notes
        assert "--kv-events-config '{" in notes


# --- the umbrella chart (chart + official NATS chart) -------------------------------------

def test_stack_declares_nats_behind_a_condition() -> None:
    chart = load_all((STACK / "Chart.yaml").read_text())[0]
    deps = {d["name"]: d for d in chart["dependencies"]}
    assert deps["kv-bridge"]["repository"] == "file://../kv-bridge"
    assert deps["nats"]["condition"] == "nats.enabled"
    assert deps["nats"]["repository"] == "https://nats-io.github.io/k8s/helm/charts/"


@pytest.mark.parametrize(("release", "url"), [("demo", "nats://demo-nats:4222"), ("my-nats", "nats://my-nats:4222")])
def test_stack_points_the_bridge_at_its_nats(tmp_path: Path, release: str, url: str) -> None:
    """Offline stand-in for `helm dependency build`: the umbrella without the
    NATS dependency (which needs the network), with kv-bridge from this tree."""
    stack = tmp_path / "stack"
    shutil.copytree(STACK, stack)
    chart = load_all((stack / "Chart.yaml").read_text())[0]
    chart["dependencies"] = [d for d in chart["dependencies"] if d["name"] != "nats"]
    chart["dependencies"][0]["repository"] = f"file://{CHART}"
    (stack / "Chart.yaml").write_text(json.dumps(chart))
    helm("dependency", "build", str(stack))
    docs = load_all(helm("template", release, str(stack), "--namespace", NAMESPACE).stdout)
    env = env_map(sidecar_of(the_workload(docs)["spec"]["template"]["spec"]))
    assert env["KVB_NATS_URL"]["value"] == url
    packaged = {p.name for p in (stack / "charts").iterdir()}
    assert packaged == {f"kv-bridge-{load_all((CHART / 'Chart.yaml').read_text())[0]['version']}.tgz"}
