"""`kv-bridge watch --once`: a table with each worker's groups, media and liveness."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import anyio
import msgspec
import nats
import pytest
from rich.console import Console

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.apps.watch import RateMeter, build_table
from bridge.cli import main
from bridge.contract import GroupInfo, RankInfo, WorkerEntry, encode_entry, registry_key
from bridge.producer.sink.registry_writer import WorkerRegistry
from bridge.residency.index import ResidencyIndex
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import make_settings, running_bridge
from tests.client.builders import hb, msg, record, stored

pytestmark = pytest.mark.anyio


def _entry(worker: str) -> WorkerEntry:
    return WorkerEntry(
        worker=worker, ranks=[RankInfo(0)], groups=[GroupInfo(0, "full_attention", "attention", 16)],
        started_at=time.time(), heartbeat_interval=1.0,
    )


async def test_watch_once_shows_the_worker_its_groups_and_liveness(
    nats_server: NatsServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    publisher = WirePublisher(f"tcp://*:{port}", None)
    settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{port}"], nats_url=[nats_server.url], worker_id="pod-w")
    nc = await nats.connect(nats_server.url)
    registry = WorkerRegistry(nc.jetstream(), "kv_workers", ttl=60)
    await registry.put(_entry("pod-w"))
    # a worker whose bridge vanished a minute ago: in the registry only
    kv = await registry.open()
    gone = msgspec.structs.replace(_entry("pod-gone"), heartbeat_ts=time.time() - 60)
    await kv.put(registry_key("pod-gone"), encode_entry(gone))
    workload = HybridWorkload(seed=3)
    codes: list[int] = []
    try:
        async with running_bridge(settings):
            thread = threading.Thread(target=lambda: codes.append(main(
                ["watch", "--nats-url", nats_server.url, "--once", "--duration", "2", "--width", "200"])))
            thread.start()
            with anyio.fail_after(20):
                while thread.is_alive():
                    publisher.publish(workload.batch(6))
                    await anyio.sleep(0.05)
            thread.join(5)
    finally:
        publisher.close()
        await nc.close()
    assert codes == [0]
    screen = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in screen.splitlines() if line.startswith("│") and "pod-" in line}
    assert set(rows) == {"pod-w", "pod-gone"}, screen
    assert "alive" in rows["pod-w"] and "dead" in rows["pod-gone"]
    for header in ("g0 attention", "g1 window", "g2 state", "registry on"):
        assert header in screen
    assert "GPU " in rows["pod-w"] and "/s" in screen


def test_table_marks_stale_views_and_shows_suspect_counts() -> None:
    index = ResidencyIndex()
    index.apply(msg([stored([hb(i) for i in range(5)])], worker="a", seq=1))
    index.apply(record("gap", worker="a", gap=(1, 3)))
    index.apply(msg([stored([hb(9)], medium="CPU")], worker="a", seq=4))
    console = Console(width=160, record=True)
    console.print(build_table(index, None, RateMeter()))
    text = console.export_text()
    row = next(line for line in text.splitlines() if "│ a " in line)
    assert "1 stale" in row and "GPU 0 +5?" in row and "CPU 1" in row and "watching" in row


async def test_watch_live_view_ends_after_duration(nats_server: NatsServerProcess,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["watch", "--nats-url", nats_server.url, "--duration", "1", "--refresh", "0.2", "--registry-bucket", ""]
    code = await anyio.to_thread.run_sync(main, argv)
    assert code == 0
    assert "kv-bridge watch — 0 worker ranks, registry off" in capsys.readouterr().out


async def test_watch_exits_zero_on_ctrl_c(nats_server: NatsServerProcess) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "bridge", "watch", "--nats-url", nats_server.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # give it time to connect and draw; then the user presses Ctrl-C
        await anyio.sleep(2.0)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, err = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=10))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err


def test_a_snapshots_counters_are_no_rate() -> None:
    """A view restored from a snapshot carries its rank's lifetime counters:
    the rates start from it, not from zero (a late `watch` showed thousands
    of stores a second that never happened)."""
    source = ResidencyIndex()
    for i in range(50):
        source.apply(msg([stored([hb(i)])], seq=i + 1))
    snap = source.snapshot("w", 0)
    assert snap is not None and snap.groups[0].stored == 50
    index = ResidencyIndex()
    rates = RateMeter(smoothing=1.0)
    rates.sample(index, 100.0)
    index.apply(snap)
    rates.restored(snap_key := index.view("w", 0).key)  # type: ignore[union-attr]
    rates.sample(index, 101.0)
    assert rates.rates.get((snap_key, 0), (0.0, 0.0))[0] == 0.0
    for i in range(50, 60):
        index.apply(msg([stored([hb(i)])], seq=i + 1))
    rates.sample(index, 102.0)
    assert rates.rates[(snap_key, 0)][0] == 10.0
