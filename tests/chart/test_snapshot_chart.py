"""The chart's residency-snapshot values (bridge.snapshots, observe.bootstrap):
what reaches the sidecar as KVB_SNAPSHOT* variables, in both modes, and what
the observe Deployment is told (docs/kubernetes.md, docs/contract.md "Snapshots").

Needs helm: `bash scripts/install-chart-tools.sh`.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart.helmutil import (
    CHART,
    CI_VALUES,
    INSTALL_HINT,
    RELEASE,
    by_kind,
    env_map,
    helm,
    load_all,
    render,
    sidecar_of,
    sidecar_patch,
    the_workload,
    tool,
)

pytestmark = pytest.mark.skipif(tool("helm") is None, reason=f"helm is not installed: {INSTALL_HINT}")

CI = {p.stem.removesuffix("-values"): p for p in CI_VALUES}
SNAPSHOT_ENV = ("KVB_SNAPSHOTS", "KVB_SNAPSHOT_BUCKET", "KVB_SNAPSHOT_INTERVAL", "KVB_SNAPSHOT_EVENTS",
                "KVB_SNAPSHOT_LOG_BYTES")


def _sidecar_env(docs: list[dict[str, Any]]) -> dict[str, str | None]:
    side = sidecar_of(the_workload(docs)["spec"]["template"]["spec"])
    return {k: v.get("value") for k, v in env_map(side).items()}


def _snapshot_env(env: dict[str, str | None]) -> dict[str, str | None]:
    return {k: env[k] for k in SNAPSHOT_ENV if k in env}


def _observe_args(docs: list[dict[str, Any]]) -> list[str]:
    (dep,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-observe")]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return list(c["args"])


def test_snapshots_are_on_by_default_with_the_bridges_defaults() -> None:
    env = _sidecar_env(render(None))
    # Only what the values say: interval, events and log bytes keep the bridge's own defaults.
    assert _snapshot_env(env) == {"KVB_SNAPSHOTS": "true", "KVB_SNAPSHOT_BUCKET": "kv_snapshots"}


def test_snapshot_values_reach_the_sidecar() -> None:
    env = _sidecar_env(render(CI["jetstream"]))
    assert _snapshot_env(env) == {
        "KVB_SNAPSHOTS": "true",
        "KVB_SNAPSHOT_BUCKET": "kv_snapshots_prod",
        "KVB_SNAPSHOT_INTERVAL": "10",
        "KVB_SNAPSHOT_EVENTS": "2000000",  # not 2e+06
        "KVB_SNAPSHOT_LOG_BYTES": "67108864",
    }


def test_disabled_snapshots_say_false_and_nothing_else() -> None:
    env = _sidecar_env(render(None, "bridge.snapshots.enabled=false", "bridge.snapshots.interval=10"))
    assert _snapshot_env(env) == {"KVB_SNAPSHOTS": "false"}


def test_disabled_snapshots_in_the_sidecar_patch() -> None:
    patch = load_all(sidecar_patch(render(CI["sidecar"]))["data"]["sidecar-patch.yaml"])[0]
    side = sidecar_of(patch["spec"]["template"]["spec"])
    env = {k: v.get("value") for k, v in env_map(side).items()}
    assert _snapshot_env(env) == {"KVB_SNAPSHOTS": "false"}


def test_an_empty_bucket_turns_the_bucket_off() -> None:
    env = _sidecar_env(render(None, "bridge.snapshots.bucket="))
    assert env["KVB_SNAPSHOTS"] == "true" and env["KVB_SNAPSHOT_BUCKET"] == ""


@pytest.mark.parametrize(("setting", "why"), [
    ("bridge.snapshots.logBytes=1024", "minimum"),          # the bridge wants at least 1 MiB
    ("bridge.snapshots.interval=0.5", "minimum"),           # at least 1 s
    ("bridge.snapshots.events=0", "minimum"),
    ('bridge.snapshots.bucket="kv.snapshots"', "pattern"),  # not a bucket name
    ('bridge.snapshots.enabled="maybe"', "boolean"),
    ("bridge.snapshots.nope=1", "additional properties"),
])
def test_schema_refuses_snapshot_values_the_bridge_would(setting: str, why: str) -> None:
    # --set-json: plain --set passes 0.5 as a string, which would fail for the wrong reason.
    proc = helm("template", RELEASE, str(CHART), "--set-json", setting, check=False)
    assert proc.returncode != 0, setting
    assert "snapshots" in proc.stderr and why in proc.stderr, proc.stderr


def test_observe_reads_the_bucket_the_bridges_write() -> None:
    on = ("observe.enabled=true",)
    args = _observe_args(render(None, *on, "bridge.jetstream.enabled=true", "bridge.snapshots.bucket=snaps"))
    assert args[args.index("--snapshot-bucket") + 1] == "snaps"
    assert "--no-bootstrap" not in args
    # Core-mode bridges write no bucket; bridges without snapshots have none.
    for sets in ((), ("bridge.jetstream.enabled=true", "bridge.snapshots.enabled=false")):
        args = _observe_args(render(None, *on, *sets))
        assert args[args.index("--snapshot-bucket") + 1] == ""


def test_observe_bootstrap_can_be_off_and_since_snapshot_passes() -> None:
    args = _observe_args(render(None, "observe.enabled=true", "observe.bootstrap=false"))
    assert "--no-bootstrap" in args
    args = _observe_args(render(None, "observe.enabled=true", "bridge.jetstream.enabled=true",
                                "observe.since=snapshot"))
    assert args[args.index("--since") + 1] == "snapshot"
