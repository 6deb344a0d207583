"""The server closes the bridge's NATS client for good: nats-py gives up on a
client after any server `-ERR` but a permission error, here an authorization
change (the server reloads its config with the bridge user's password
changed: `-ERR 'Authorization Violation'`, then the connection is closed).
The bridge must connect again once it may, publish on, name every batch it
cannot vouch for, turn /healthz unhealthy while NATS stays unusable past
--nats-unhealthy-after, and exit 0 on SIGTERM, connected or not."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import endpoints
from tests.faults.harness import (
    BridgeProcess,
    account,
    capture_stream,
    fault_batch,
    http_get,
    metric_value,
    read_stream,
    report,
    wait_http,
    wait_metric,
    wait_until,
)

pytestmark = pytest.mark.anyio

READER = ("reader", "reader-secret")
BRIDGE_USER = "bridge"
GOOD, CHANGED = "bridge-secret", "rotated-secret"
UNHEALTHY_AFTER = 2.0


class AuthServer:
    """A nats-server whose users come from a config file it reloads on SIGHUP."""

    def __init__(self, tmp_path: Path) -> None:
        self.conf = tmp_path / "nats.conf"
        store = tmp_path / "store"
        store.mkdir()
        self.write(GOOD)
        self.server = NatsServerProcess(jetstream=True, store_dir=str(store), extra_args=["-c", str(self.conf)])

    def write(self, bridge_password: str) -> None:
        self.conf.write_text(
            "authorization {\n  users = [\n"
            f'    {{user: "{READER[0]}", password: "{READER[1]}"}}\n'
            f'    {{user: "{BRIDGE_USER}", password: "{bridge_password}"}}\n'
            "  ]\n}\n"
        )

    def reload(self, bridge_password: str) -> None:
        self.write(bridge_password)
        assert self.server.proc is not None
        self.server.proc.send_signal(signal.SIGHUP)

    @property
    def reader_url(self) -> str:
        return self.server.url.replace("nats://", f"nats://{READER[0]}:{READER[1]}@")


def _bind(ep: str) -> str:
    return ep.replace("127.0.0.1", "*")


async def _publish(pub: WirePublisher, first: int, count: int, rate: float = 200.0) -> None:
    for k in range(first, first + count):
        pub.publish(fault_batch(0, k))
        await anyio.sleep(1.0 / rate)
    await anyio.to_thread.run_sync(pub.wait_idle)


def _healthz(port: int) -> int:
    return http_get(f"http://127.0.0.1:{port}/healthz")[0]


async def _closed_and_replaced(tmp_path: Path, jetstream: bool) -> None:
    auth = AuthServer(tmp_path)
    auth.server.start()
    try:
        if not jetstream:
            await capture_stream(auth.reader_url)
        pub_ep, replay_ep = endpoints()
        pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
        http = free_port()
        args = ["--zmq-endpoint", pub_ep, "--replay-endpoint", replay_ep, "--nats-url", auth.server.url,
                "--nats-user", BRIDGE_USER, "--worker-id", "fault-worker", "--http-port", str(http),
                "--http-host", "127.0.0.1", "--nats-unhealthy-after", str(UNHEALTHY_AFTER)]
        if jetstream:
            args += ["--jetstream", "--js-ack-timeout", "1"]
        bridge = BridgeProcess(args, tmp_path / "bridge.log", env={"KVB_NATS_PASSWORD": GOOD}).start()
        before, during, after = 150, 100, 150
        try:
            await wait_http(http, timeout=90)
            await _publish(pub, 0, before)
            await wait_metric(http, "kvbridge_batches_out_total", lambda v: v >= before)
            closed_at = time.monotonic()
            auth.reload(CHANGED)  # the server closes the bridge's client; its password no longer works
            await wait_metric(http, "kvbridge_nats_connected", lambda v: v == 0)
            await _publish(pub, before, during)
            # NATS unusable past the bound: the orchestrator is told to restart the bridge
            await wait_until(lambda: _healthz(http) == 503, timeout=UNHEALTHY_AFTER + 20)
            unhealthy_after = time.monotonic() - closed_at
            auth.reload(GOOD)
            await wait_metric(http, "kvbridge_nats_clients_replaced_total", lambda v: v >= 1, timeout=40)
            replaced_after = time.monotonic() - closed_at
            await wait_until(lambda: _healthz(http) == 200)
            await _publish(pub, before + during, after)
            sent = before + during + after
            await wait_metric(http, "kvbridge_batches_out_total", lambda v: v >= sent, timeout=40)
            metrics = http_get(f"http://127.0.0.1:{http}/metrics")[1]
            code = await anyio.to_thread.run_sync(bridge.stop)
        finally:
            bridge.stop()
            pub.close()
        logs = bridge.logs()
        stream = "KV_EVENTS" if jetstream else "FAULT_CAPTURE"
        mode = "jetstream" if jetstream else "core"
        fig = account(f"nats_client_closed_auth_change_{mode}", {0: sent},
                      await read_stream(auth.reader_url, stream),
                      notes=f"unhealthy_after={unhealthy_after:.1f}s replaced_after={replaced_after:.1f}s "
                            f"gaps={metric_value(metrics, 'kvbridge_gap_batches_total'):.0f}")
        report(fig)
    finally:
        auth.server.stop()
    assert code == 0, f"bridge exited {code}"
    events = [entry["event"] for entry in logs]
    assert "nats_client_closed" in events and "nats_client_replaced" in events
    assert fig.unannounced == 0, f"batches neither published nor named by a gap: {fig.lost_seqs}"
    assert fig.out_of_order == 0 and fig.wrong_seq == 0 and fig.duplicated == 0
    if jetstream:
        # the ack window sends what the closed client took with it again: nothing lost
        assert fig.lost == 0 and fig.gap_records == 0, fig.lost_seqs


async def test_a_client_closed_by_the_server_is_replaced_jetstream(tmp_path: Path) -> None:
    await _closed_and_replaced(tmp_path, jetstream=True)


async def test_a_client_closed_by_the_server_is_replaced_core(tmp_path: Path) -> None:
    await _closed_and_replaced(tmp_path, jetstream=False)


async def test_sigterm_while_nats_is_unusable_exits_0(tmp_path: Path) -> None:
    """Closed by the server and not let back in: SIGTERM still ends the
    bridge with exit 0 within its drain time (no traceback from the registry
    writer or the snapshot service on the dead client)."""
    auth = AuthServer(tmp_path)
    auth.server.start()
    try:
        pub_ep, replay_ep = endpoints()
        pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
        http = free_port()
        args = ["--zmq-endpoint", pub_ep, "--replay-endpoint", replay_ep, "--nats-url", auth.server.url,
                "--nats-user", BRIDGE_USER, "--worker-id", "fault-worker", "--http-port", str(http),
                "--http-host", "127.0.0.1", "--jetstream", "--drain-timeout", "2"]
        bridge = BridgeProcess(args, tmp_path / "bridge.log", env={"KVB_NATS_PASSWORD": GOOD}).start()
        try:
            await wait_http(http, timeout=90)
            await _publish(pub, 0, 20)
            await wait_metric(http, "kvbridge_batches_out_total", lambda v: v >= 20)
            auth.reload(CHANGED)
            await wait_metric(http, "kvbridge_nats_connected", lambda v: v == 0)
            await _publish(pub, 20, 20)
            began = time.monotonic()
            code = await anyio.to_thread.run_sync(bridge.stop)
            took = time.monotonic() - began
        finally:
            bridge.stop()
            pub.close()
    finally:
        auth.server.stop()
    assert code == 0, f"bridge exited {code}"
    assert not any("Traceback" in line for line in (tmp_path / "bridge.log").read_text().splitlines())
    assert took < 20, f"SIGTERM took {took:.1f} s"
