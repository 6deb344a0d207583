"""Running helm and kubernetes-validate for the chart tests.

The tools come from `bash scripts/install-chart-tools.sh` (repo-local .tools/bin)
or, failing that, from PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kv-bridge"
STACK = CHART.parent / "kv-bridge-stack"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
TOOLS_BIN = Path(os.environ.get("KVB_TOOLS_DIR", REPO / ".tools")) / "bin"
RELEASE = "kvb"
NAMESPACE = "kvb-test"
INSTALL_HINT = "run `bash scripts/install-chart-tools.sh` (installs helm v4, kubernetes-validate, hadolint into .tools/)"

# Kinds kubernetes-validate has no schema for (CRDs); checked by hand instead.
CRD_KINDS = {"PodMonitor", "PrometheusRule"}
# The chart's kubeVersion floor and the newest schema kubernetes-validate ships.
K8S_VERSIONS = ("1.29.0", "1.37.0")


def tool(name: str) -> str | None:
    local = TOOLS_BIN / name
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def run(cmd: list[str], *, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = tool("helm")
    assert exe, f"helm not found: {INSTALL_HINT}"
    return run([exe, *args], check=check)


def load_all(text: str) -> list[dict[str, Any]]:
    """Parse a YAML stream (PyYAML if importable, else the tools venv's)."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - the project venv normally has PyYAML
        py = Path(os.environ.get("KVB_TOOLS_DIR", REPO / ".tools")) / "venv" / "bin" / "python"
        code = "import json,sys,yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))"
        out = subprocess.run([str(py), "-c", code], input=text, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)
    return [d for d in yaml.safe_load_all(text) if d]


@lru_cache(maxsize=None)
def template_text(values_file: str | None = None, *sets: str, release: str = RELEASE) -> str:
    args = ["template", release, str(CHART), "--namespace", NAMESPACE]
    if values_file:
        args += ["-f", values_file]
    for s in sets:
        args += ["--set", s]
    return helm(*args).stdout


def render(values_file: str | Path | None = None, *sets: str) -> list[dict[str, Any]]:
    return load_all(template_text(str(values_file) if values_file else None, *sets))


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def workload(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    found = [d for d in docs if d.get("kind") in ("Deployment", "StatefulSet")]
    assert len(found) <= 1, f"expected at most one workload, got {[d['kind'] for d in found]}"
    return found[0] if found else None


def the_workload(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The workload (`workload`) of a rendering that must have one."""
    found = workload(docs)
    assert found is not None, "expected a Deployment or StatefulSet"
    return found


def sidecar_of(pod_spec: dict[str, Any]) -> dict[str, Any]:
    matches = [c for c in pod_spec.get("initContainers", []) if c["name"] == "kv-bridge"]
    assert len(matches) == 1, "exactly one kv-bridge init container expected"
    return matches[0]


def vllm_of(pod_spec: dict[str, Any]) -> dict[str, Any]:
    matches = [c for c in pod_spec.get("containers", []) if c["name"] == "vllm"]
    assert len(matches) == 1, "exactly one vllm container expected"
    return matches[0]


def env_map(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> the EnvVar (last one wins, as in Kubernetes)."""
    return {e["name"]: e for e in container.get("env", [])}


def sidecar_patch(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cms = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-sidecar")]
    assert len(cms) == 1, "sidecar mode renders one <fullname>-sidecar ConfigMap"
    return cms[0]


def validate(docs: list[dict[str, Any]], tmp_path: Path, k8s_version: str) -> subprocess.CompletedProcess[str]:
    """kubernetes-validate --strict over every non-CRD document."""
    exe = tool("kubernetes-validate")
    assert exe, f"kubernetes-validate not found: {INSTALL_HINT}"
    files = []
    for i, doc in enumerate(d for d in docs if d.get("kind") not in CRD_KINDS):
        f = tmp_path / f"{i:02d}-{doc['kind']}.json"
        f.write_text(json.dumps(doc))
        files.append(str(f))
    assert files, "nothing to validate"
    return run([exe, "--strict", "--kubernetes-version", k8s_version, *files], check=False)
