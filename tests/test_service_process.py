"""`kv-bridge run` as a real process: HTTP endpoints, SIGTERM drain, config errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import cast

import anyio
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.contract import WorkerRecord
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import BusCollector, endpoints

pytestmark = pytest.mark.anyio


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _wait_http(url: str, status: int, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    last: tuple[int, str] = (0, "")
    while time.monotonic() < deadline:
        try:
            last = _get(url)
            if last[0] == status:
                return last[1]
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered {status}: {last}")


def _spawn(args: list[str], env: dict[str, str] | None = None,
           launcher: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*launcher, sys.executable, "-m", "bridge", "run", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_sigterm_drains_everything_received_and_exits_zero(nats_server: NatsServerProcess) -> None:
    pub_ep, replay_ep = endpoints()
    http = free_port()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    bus = await BusCollector().start(nats_server.url)
    # settings through the environment, one through a flag that must win over its variable
    proc = _spawn(["--http-port", str(http), "--format", "msgpack"], env={
        "KVB_ZMQ_ENDPOINT": pub_ep, "KVB_REPLAY_ENDPOINT": replay_ep, "KVB_NATS_URL": nats_server.url,
        "KVB_WORKER_ID": "drain-test", "KVB_HTTP_HOST": "127.0.0.1", "KVB_FORMAT": "json",
    })
    try:
        await anyio.to_thread.run_sync(_wait_http, f"http://127.0.0.1:{http}/readyz", 200)
        status, text = _get(f"http://127.0.0.1:{http}/healthz")
        assert status == 200
        workload = HybridWorkload(seed=3)
        sent = 300
        for _ in range(sent):
            pub.publish(workload.batch(64))
        # stop as soon as the bridge has taken every batch off ZMQ, before NATS has necessarily seen them
        def received_all() -> bool:
            return _metric(_get(f"http://127.0.0.1:{http}/metrics")[1], "kvbridge_batches_in_total") >= sent
        deadline = time.monotonic() + 30
        while not await anyio.to_thread.run_sync(received_all):
            assert time.monotonic() < deadline
        proc.send_signal(signal.SIGTERM)
        rc = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30))
        assert rc == 0
        await bus.wait_for(lambda b: len(b.records("stop")) == 1, timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
        await bus.close()
    assert bus.seqs() == list(range(sent))
    assert cast(WorkerRecord, bus.items[-1].body).type == "stop"
    assert proc.stderr is not None
    logs = [json.loads(line) for line in proc.stderr.read().decode().splitlines() if line.startswith("{")]
    assert any(entry["event"] == "bridge_stopped" and entry["left"] == 0 for entry in logs)


async def test_readyz_waits_for_nats_and_healthz_does_not() -> None:
    nats_port, http = free_port(), free_port()
    pub_ep, _ = endpoints()
    proc = _spawn(["--zmq-endpoint", pub_ep, "--nats-url", f"nats://127.0.0.1:{nats_port}",
                   "--http-port", str(http), "--http-host", "127.0.0.1", "--worker-id", "w"])
    try:
        body = await anyio.to_thread.run_sync(_wait_http, f"http://127.0.0.1:{http}/readyz", 503)
        assert "nats_connected=False" in body
        assert _get(f"http://127.0.0.1:{http}/healthz")[0] == 200
        assert "kvbridge_nats_connected 0.0" in _get(f"http://127.0.0.1:{http}/metrics")[1]
        with NatsServerProcess(port=nats_port):
            await anyio.to_thread.run_sync(_wait_http, f"http://127.0.0.1:{http}/readyz", 200)
            proc.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=20)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_invalid_configuration_names_the_option() -> None:
    cases = [
        (["--dp-ranks", "0"], "--dp-ranks"),
        (["--zmq-endpoint", "http://x"], "--zmq-endpoint"),
        (["--group-kind", "1=mambo"], "--group-kind"),
        (["--subject-prefix", "kv.>"], "--subject-prefix"),
        (["--nats-tls-ca", "/nonexistent/ca.pem"], "--nats-tls-ca"),
    ]
    for args, option in cases:
        proc = subprocess.run([sys.executable, "-m", "bridge", "run", *args], capture_output=True, timeout=30)
        assert proc.returncode == 2, args
        assert option in proc.stderr.decode(), (args, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "bridge", "run"], capture_output=True, timeout=30,
                          env={**os.environ, "KVB_MAX_BUFFERED_BATCHES": "lots"})
    assert proc.returncode == 2 and "--max-buffered-batches" in proc.stderr.decode()


async def test_without_nats_url_run_starts_its_own_nats_server() -> None:
    pub_ep, _ = endpoints()
    http = free_port()
    proc = _spawn(["--zmq-endpoint", pub_ep, "--http-port", str(http), "--http-host", "127.0.0.1",
                   "--worker-id", "solo", "--log-format", "json"])
    try:
        await anyio.to_thread.run_sync(_wait_http, f"http://127.0.0.1:{http}/readyz", 200)
        url = None
        assert proc.stderr is not None
        while url is None:
            line = await anyio.to_thread.run_sync(proc.stderr.readline)
            assert line, "bridge exited before saying where NATS listens"
            if line.startswith(b"{"):
                entry = json.loads(line)
                if entry["event"] == "embedded_nats_listening":
                    url = entry["url"]
        bus = await BusCollector().start(url)
        pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), None)
        try:
            await anyio.sleep(0.5)
            pub.publish(HybridWorkload(seed=5).batch(8))
            await bus.wait_for(lambda b: len(b.groups()) >= 1)
        finally:
            pub.close()
            await bus.close()
        assert bus.groups()[0].worker == "solo"
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=20)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _stopping_without_nats(drain_timeout: str,
                           launcher: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], int]:
    """A bridge whose NATS never comes: once signalled, its drain waits
    --drain-timeout for a server to flush its stop record to. `launcher`:
    what runs it (`env --ignore-signal=HUP`, say)."""
    pub_ep, _ = endpoints()
    http = free_port()
    proc = _spawn(["--zmq-endpoint", pub_ep, "--nats-url", f"nats://127.0.0.1:{free_port()}",
                   "--http-port", str(http), "--http-host", "127.0.0.1", "--worker-id", "signals",
                   "--drain-timeout", drain_timeout], launcher=launcher)
    return proc, http


def _events(proc: subprocess.Popen[bytes]) -> list[str]:
    assert proc.stderr is not None
    return [json.loads(line)["event"] for line in proc.stderr.read().decode().splitlines() if line.startswith("{")]


async def test_sigterm_again_during_the_drain_changes_nothing() -> None:
    """`timeout`, and supervisors that signal a process and then its group,
    send SIGTERM twice: the drain goes on to its end and the bridge exits 0."""
    proc, http = _stopping_without_nats("2")
    try:
        await anyio.to_thread.run_sync(_wait_http, f"http://127.0.0.1:{http}/healthz", 200)
        proc.send_signal(signal.SIGTERM)
        await anyio.sleep(0.3)  # well inside the 2 s drain
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    events = _events(proc)
    assert "signal_ignored" in events and "drain_timeout" in events and events[-1] == "bridge_stopped", events


async def test_sighup_drains_and_exits_zero_like_sigterm() -> None:
    """A closed terminal or ssh session, or the kernel hanging up a process
    group whose parent left while one of them was stopped: the bridge
    drains and stops, logged, instead of dying silently."""
    # SIGHUP at its default whatever this test runner inherited.
    proc, http = _stopping_without_nats("2", launcher=("env", "--default-signal=HUP"))
    try:
        await anyio.to_thread.run_sync(_wait_http, f"http://127.0.0.1:{http}/healthz", 200)
        proc.send_signal(signal.SIGHUP)
        await anyio.sleep(0.3)
        proc.send_signal(signal.SIGHUP)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.stderr is not None
    lines = [json.loads(line) for line in proc.stderr.read().decode().splitlines() if line.startswith("{")]
    events = [line["event"] for line in lines]
    assert {"event": "signal", "signal": "SIGHUP"}.items() <= next(x for x in lines if x["event"] == "signal").items()
    assert "signal_ignored" in events and "drain_timeout" in events and events[-1] == "bridge_stopped", events


async def test_a_bridge_started_under_nohup_keeps_ignoring_sighup() -> None:
    proc, http = _stopping_without_nats("1", launcher=("env", "--ignore-signal=HUP"))
    try:
        await anyio.to_thread.run_sync(_wait_http, f"http://127.0.0.1:{http}/healthz", 200)
        proc.send_signal(signal.SIGHUP)
        await anyio.sleep(1.0)
        assert proc.poll() is None  # still running, still serving
        assert _get(f"http://127.0.0.1:{http}/healthz")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "signal" in _events(proc)


async def test_a_second_sigint_ends_the_bridge_at_once() -> None:
    """Ctrl-C twice at a terminal: the second ends the process without the drain."""
    proc, http = _stopping_without_nats("120")
    try:
        await anyio.to_thread.run_sync(_wait_http, f"http://127.0.0.1:{http}/healthz", 200)
        proc.send_signal(signal.SIGINT)
        await anyio.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        # long before the 120 s drain could end
        assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == -signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
    events = _events(proc)
    assert "signal_again" in events and "bridge_stopped" not in events, events
