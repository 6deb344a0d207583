"""`kv-bridge demo` shows the whole flow: every group family, a clear, start and stop."""

import io

import anyio

from bridge.apps.demo.run import run_demo
from tests.busutil import make_settings


def test_demo_prints_every_family_and_the_worker_records() -> None:
    out = io.StringIO()
    rc = anyio.run(run_demo, make_settings(worker_id="demo-worker"), 45, 0.01, 6, out)
    text = out.getvalue()
    assert rc == 0
    for needle in ["attention/full_attention", "window/sliding_window", "state/mamba", "WORKER START",
                   "WORKER CLEARED", "WORKER STOP", "kv.demo-worker.0", "kv.demo-worker.2"]:
        assert needle in text, needle
    assert "done, 45 batches" in text
