"""The residency index benchmark's smoke variant (`python -m bench.index --smoke`), so it never rots.

It asserts that every figure came out and that the fleet structure and
today's index gave the same answers on the sampled queries, never how fast
anything was: the figures of a seconds-long run on a shared machine mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("form", ["int", "bytes"])
def test_smoke_index_benchmark_yields_figures_and_both_indexes_agree(tmp_path: Path, form: str) -> None:
    out = tmp_path / "index.json"
    proc = subprocess.run([sys.executable, "-m", "bench.index", "--smoke", "--form", form, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["answers_agree"] and summary["answers_compared"] > 0
    for name, run in result["runs"].items():
        assert run["entries"] > 0 and run["hashes_ingested"] > 0, name
        assert run["ingest_per_s"] > 0 and run["bytes_per_entry"] is not None, name
        assert run["longest_prefix"]["n"] > 0 and run["longest_prefix"]["p99_ms"] > 0, name
    fleet = result["runs"]["fleet"]
    assert fleet["prefix_hits"]["n"] > 0 and fleet["distinct_hashes"] > 0
    assert {"returning", "shared"} <= set(fleet["by_kind"])
    assert "longest_prefix p99 ms" in proc.stdout and "agree" in proc.stdout
