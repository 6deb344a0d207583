"""The snapshot benchmark's smoke variant (`python -m bench.snapshot --smoke`), so it never rots.

It asserts that every figure came out and that what was fetched from the real
bridge holds the blocks the bridge holds, never how fast anything was: the
figures of a seconds-long run on a shared machine mean nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_smoke_snapshot_benchmark_yields_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "snapshot.json"
    proc = subprocess.run([sys.executable, "-m", "bench.snapshot", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for form in ("int", "bytes"):
        take = result["take"][form]
        assert take["blocks"] >= take["target"] > 0 and take["size_bytes"] > 0 and take["parts"] >= 1
        assert all(v > 0 for v in take["ms"].values()), take["ms"]
        big = result["take_big"][form]
        assert big["blocks"] >= result["plan"]["big"] and big["size_bytes"] > take["size_bytes"]
        fetch = result["fetch"][form]
        assert fetch["blocks"] == fetch["bridge_entries"] > 0 and fetch["parts"] >= 1
        assert fetch["fetch_ms"] > 0 and fetch["largest_answer_bytes"] <= fetch["max_payload"]
        for blocks in (result["plan"]["blocks"], result["plan"]["big"]):
            mem = result["memory"][f"{form}-{blocks}"]
            assert mem["blocks"] >= blocks and mem["bytes_per_block"] is not None
    assert "bytes/block" in proc.stdout and "fetch" in proc.stdout
