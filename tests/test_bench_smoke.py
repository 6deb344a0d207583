"""The benchmark's smoke variant (`python -m bench.run --smoke`), so it never rots.

It asserts that every mode produced well-formed figures and that kv-bridge
delivered every event it was given, never how fast anything was: CI machines
differ, and the figures of a seconds-long run mean nothing anyway.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.runtime.nats_server import nats_server_available

ROOT = Path(__file__).resolve().parent.parent
MODES = ("floor", "naive", "minimal", "core", "minimal-js", "jetstream")
SIZES = ("8", "64", "512")

pytestmark = pytest.mark.skipif(not nats_server_available(), reason="needs the nats-server binary")


def test_smoke_benchmark_yields_figures_for_every_mode_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(out),
         "--log-dir", str(tmp_path / "logs"), "--cache-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert out.is_file(), f"no figures written\n{proc.stdout}\n{proc.stderr}"
    results = json.loads(out.read_text())
    assert proc.returncode == 0, f"a run lost or missed events\n{proc.stdout}\n{proc.stderr}"
    assert "targets:" in proc.stdout

    table = results["summary"]["table"]
    for mode in MODES:
        assert table[mode]["peak_rss_mb"] > 0
        for size in SIZES:
            row = table[mode][size]
            assert row["runs"] >= 1 and row["all_ok"], (mode, size, row)
            assert row["events_per_s"] > 0 and row["cpu_s_per_m_events"] >= 0
            assert row["ratio_to_floor"] > 0 and row["ratio_to_naive"] > 0
            if mode == "naive":
                continue  # the naive bridge cannot take 50k events/s; its latency run is skipped
            lat = row["latency"]
            assert lat is not None, (mode, size, row)
            assert 0 <= lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
            assert row["peak_rss_mb_at_latency_load"] > 0

    # kv-bridge delivered every event it forwards (window placeholders are dropped by design), no gaps.
    bridge_runs = [s for s in results["throughput"] + results["latency"]
                   if s["mode"] in ("core", "jetstream") and "skipped" not in s]
    assert len(bridge_runs) == 2 * 2 * len(SIZES)
    for run in bridge_runs:
        assert run["delivered"] == run["expected"] > 0 and run["gap_records"] == 0, run
        # what the bridge's residency let go is read from its /metrics, for every run
        assert isinstance(run["residency_shed_messages"], int) and run["residency_shed_messages"] >= 0, run

    overload = results["overload"]
    assert overload["batches_published"] > 0 and overload["rss_samples"]
    assert overload["gap_records"] >= 1 and overload["batches_announced_lost"] > 0
    # The p99 targets show the minimal relay's figure beside kv-bridge's: the same messages with next to no relay work.
    for name, yardstick in (("core_p99_ms", "minimal"), ("jetstream_p99_ms", "minimal-js")):
        for cell in results["summary"]["targets"][name]["per_size"].values():
            assert cell["yardstick"]["mode"] == yardstick and cell["yardstick"]["value"] > 0
    assert set(results["summary"]["targets"]) >= {
        "core_vs_floor", "core_vs_naive", "jetstream_vs_floor", "core_p99_ms", "jetstream_p99_ms", "overload_rss_bounded",
        "core_vs_floor_small", "core_cpu_vs_minimal", "jetstream_p99_vs_minimal_js",
    }


def test_hot_path_benchmark_measures_both_encodings(tmp_path: Path) -> None:
    """`python -m bench.hotpath --smoke --keep`: figures for map and array
    traffic, the snapshot keeper's stage included (never how fast: the smoke
    run's counts are tiny)."""
    out = tmp_path / "hotpath.json"
    proc = subprocess.run([sys.executable, "-m", "bench.hotpath", "--smoke", "--keep", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["stages"] == ["decode", "normalize", "encode", "keep"]
    cells = result["cells"]
    assert set(cells) == {"this-map", "this-array"}
    assert all(cell["ns_per_event"] > 0 for cell in cells.values())


def test_hot_path_keeper_takes_the_encoders_structs_with_bodies(tmp_path: Path) -> None:
    """`--keep --bodies`: the keeper's stage as while the relay keeps up, the
    structs handed over, not their payloads, and each batch's write applied
    at once, as the sink hands it over; the output says it was so."""
    out = tmp_path / "hotpath.json"
    proc = subprocess.run([sys.executable, "-m", "bench.hotpath", "--smoke", "--keep", "--bodies", "--map-only",
                           "--size", "64", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    cells = json.loads(out.read_text())["cells"]
    assert set(cells) == {"this-map"} and cells["this-map"]["bodies"] is True
    cell = cells["this-map"]
    assert 0 < cell["applied_at_once"] <= cell["writes"]
    assert f"keeper fed structs: this-map yes, {cell['applied_at_once']} of {cell['writes']} writes" in proc.stdout


def test_bridges_side_by_side_at_a_fixed_load() -> None:
    """`python -m bench.at_load`: each variant (its own flags) takes the load
    in turn and gets a row of medians (never how fast: the counts are tiny)."""
    proc = subprocess.run([sys.executable, "-m", "bench.at_load", "--smoke", "--size", "8", "--seconds", "0.3",
                           "--rounds", "1", "--rate", "5000", "--variant", "snap=", "--variant", "nosnap=--no-snapshots"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1:]}
    assert set(rows) == {"snap", "nosnap"}
    assert all(float(cpu) > 0 and float(rss) > 0 for cpu, _, _, rss in rows.values())
    assert "round 1 snap" in proc.stdout and "round 1 nosnap" in proc.stdout
