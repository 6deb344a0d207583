"""A real Prometheus (Debian's `prometheus` package) scrapes the bridges of
`kv-bridge demo --workers 3` and a `kv-bridge observe` fed by them: every query
of both Grafana dashboards returns data through its HTTP API, and
`promtool check metrics` passes on both /metrics bodies."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((REPO / "helm" / "kv-bridge" / "dashboards").glob("*.json"))
PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
PROMTOOL = shutil.which("promtool") or ("/usr/bin/promtool" if os.path.exists("/usr/bin/promtool") else None)
WORKERS = 3
RATE_INTERVAL = "15s"

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool not on PATH: `apt-get install -y prometheus` (.ci/run does it in CI; "
           "requirements/apt.txt has the version)",
)


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy


def _get(url: str, timeout: float = 5.0) -> bytes:
    with _OPENER.open(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
        return resp.read()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _dashboard_exprs() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        stack = list(dash["panels"])
        while stack:
            panel = stack.pop()
            stack.extend(panel.get("panels", []))
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


def concrete(expr: str) -> str:
    """Grafana's variables as a dashboard with 'All' selected sends them."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("${__rate_interval}", RATE_INTERVAL)
    expr = expr.replace("$__interval", "5s").replace("${__interval}", "5s")
    return re.sub(r"\$\{?[A-Za-z_]\w*\}?", ".*", expr)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    tmp = tmp_path_factory.mktemp("prom")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    demo = subprocess.Popen(
        [sys.executable, "-m", "bridge", "demo", "--workers", str(WORKERS), "--quiet", "--http-port", "0",
         "--http-host", "127.0.0.1", "--worker-id", "prom", "--batches", "100000", "--interval", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    procs.append(demo)
    try:
        assert demo.stdout is not None
        nats_url = ""
        bridges: list[tuple[str, int]] = []
        deadline = time.monotonic() + 60
        while len(bridges) < WORKERS and time.monotonic() < deadline:
            line = demo.stdout.readline().decode()
            if not line:
                break
            if m := re.search(r"into nats-server (\S+)", line):
                nats_url = m.group(1)
            if m := re.search(r"demo: bridge (\S+) metrics http://[^:]+:(\d+)/metrics", line):
                bridges.append((m.group(1), int(m.group(2))))
        assert nats_url and len(bridges) == WORKERS, "the demo did not announce its bridges"
        obs_port = free_port()
        observe = subprocess.Popen(
            [sys.executable, "-m", "bridge", "observe", "--nats-url", nats_url, "--http-host", "127.0.0.1",
             "--http-port", str(obs_port), "--hybrid-interval", "1"],
            stdout=subprocess.DEVNULL, stderr=(tmp / "observe.log").open("wb"), env=env, cwd=REPO)
        procs.append(observe)
        _wait_ok(f"http://127.0.0.1:{obs_port}/readyz", 30)
        prom_port = free_port()
        targets = [(f"127.0.0.1:{p}", f"bridge-{w}", "kv-bridge") for w, p in bridges]
        targets.append((f"127.0.0.1:{obs_port}", "observe-0", "kv-observe"))
        jobs: dict[str, list[dict[str, object]]] = {}
        for t, pod, job in targets:
            jobs.setdefault(job, []).append({"targets": [t], "labels": {"namespace": "kvb-test", "pod": pod}})
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": [
            {"job_name": job, "scrape_timeout": "1s", "static_configs": static} for job, static in jobs.items()]}
        (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        assert PROMETHEUS is not None
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("wb"))
        procs.append(prom)
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        _wait_ok(f"http://127.0.0.1:{prom_port}/-/ready", 30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            active = json.loads(_get(f"{api}/targets"))["data"]["activeTargets"]
            if len(active) == len(targets) and all(t["health"] == "up" for t in active):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"targets not up: {active}")
        yield {"api": api, "bridges": [p for _, p in bridges], "observe": obs_port, "nats": nats_url, "tmp": tmp}
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _wait_ok(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            _get(url, 2)
            return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _query(api: str, expr: str) -> list[object]:
    url = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(_get(url))
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_every_dashboard_query_returns_data(stack: dict[str, object]) -> None:
    api = str(stack["api"])
    exprs = _dashboard_exprs()
    assert {name for name, _, _ in exprs} == {p.name for p in DASHBOARDS}
    # rate() over RATE_INTERVAL needs two scrapes in it; give the slowest a few intervals
    deadline = time.monotonic() + 45
    empty = [(n, t, concrete(e)) for n, t, e in exprs]
    while empty and time.monotonic() < deadline:
        empty = [(n, t, e) for n, t, e in empty if not _query(api, e)]
        if empty:
            time.sleep(2)
    assert not empty, "dashboard queries without data:\n" + "\n".join(f"{n} / {t}: {e}" for n, t, e in empty)


def test_promtool_accepts_both_metrics_bodies(stack: dict[str, object]) -> None:
    bodies = {"bridge": _get(f"http://127.0.0.1:{stack['bridges'][0]}/metrics"),  # type: ignore[index]
              "observe": _get(f"http://127.0.0.1:{stack['observe']}/metrics")}
    for name, body in bodies.items():
        proc = subprocess.run([str(PROMTOOL), "check", "metrics"], input=body, capture_output=True, timeout=30)
        assert proc.returncode == 0, f"promtool on {name}'s /metrics:\n{proc.stdout.decode()}{proc.stderr.decode()}"
