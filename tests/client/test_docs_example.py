"""The consumer example in docs/consumers.md runs as printed, against a real bridge."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import anyio
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import make_settings, running_bridge

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parents[2] / "docs" / "consumers.md"


async def test_the_documented_consumer_runs(nats_server: NatsServerProcess) -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert code is not None
    script = code.group(1).replace("nats://127.0.0.1:4222", nats_server.url)
    port = free_port()
    publisher = WirePublisher(f"tcp://*:{port}", None)
    settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{port}"], nats_url=[nats_server.url], worker_id="pod-doc")
    workload = HybridWorkload(seed=5)
    try:
        async with running_bridge(settings), anyio.create_task_group() as tg:
            result: dict[str, object] = {}

            async def run_example() -> None:
                result["proc"] = await anyio.run_process([sys.executable, "-c", script], check=False)

            tg.start_soon(run_example)
            deadline = time.monotonic() + 20
            while "proc" not in result and time.monotonic() < deadline:
                publisher.publish(workload.batch(6))
                await anyio.sleep(0.05)
    finally:
        publisher.close()
    proc = result["proc"]
    assert proc.returncode == 0, proc.stderr.decode()  # type: ignore[attr-defined]
    out = proc.stdout.decode()  # type: ignore[attr-defined]
    assert "WorkerKey(worker='pod-doc', dp_rank=0) fresh" in out
    assert "0: ('attention'," in out and "2: ('state'," in out
