"""The generated roles are enough for what each process does: a bridge
(JetStream) under its `bridge-<w>` user, `observe` under its own `observe`
user (reading the bus and the registry, answering its NATS service), and a
reader asking observe over NATS (bad queries get short errors), each on
its own inbox prefix, against a nats-server configured from `kv-bridge
nats-permissions`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import nats
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.wire_writer import encode_batch, stored
from bridge.apps.fleet.options import ObserveOptions
from bridge.apps.fleet.service import ObserveService
from bridge.apps.permissions import Layout, roles, server_config
from bridge.client import settings_for
from bridge.runtime.ports import free_port
from tests.busutil import make_settings, running_bridge, wait_published
from tests.security.secure_nats import secret_word, start_server

pytestmark = pytest.mark.anyio


async def test_bridge_observe_and_reader_under_generated_users(tmp_path: Path) -> None:
    all_roles = roles(Layout(workers=["pod-a"]))
    pw = {r.user: secret_word() for r in all_roles}
    server = start_server(tmp_path, server_config(all_roles, passwords=pw), jetstream=True)
    pw_file = tmp_path / "bridge.pw"
    pw_file.write_text(pw["bridge-pod-a"])
    zmq = f"tcp://127.0.0.1:{free_port()}"
    bridge_settings = make_settings(zmq_endpoint=[zmq], nats_url=[server.url], worker_id="pod-a", jetstream=True,
                                    nats_user="bridge-pod-a", nats_password_file=str(pw_file))
    observe = settings_for(server.url, environ={"KVB_NATS_PASSWORD": pw["observe"]}, nats_user="observe",
                           nats_inbox_prefix="_INBOX.observe")
    service = ObserveService(ObserveOptions(http_host="127.0.0.1", http_port=0))
    publisher = WirePublisher(zmq.replace("127.0.0.1", "*"), None)
    try:
        async with running_bridge(bridge_settings) as bridge, anyio.create_task_group() as tg:
            await tg.start(service.run, observe)
            with anyio.fail_after(20):
                while not service.is_ready():
                    await anyio.sleep(0.1)
            k = 0
            with anyio.fail_after(20):
                while not service.state.index.views:
                    publisher.publish(encode_batch(time.time(), [stored([b"h%d" % k * 8], None, [], 16, group_idx=0,
                                                                        kind="full_attention")]))
                    k += 1
                    await anyio.sleep(0.2)
            await wait_published(bridge, k)
            reader = await nats.connect(server.url, user="reader", password=pw["reader"],
                                        inbox_prefix="_INBOX.reader")
            try:
                answer = json.loads((await reader.request("kvobserve.workers", b"", timeout=5)).data)
                assert [w["worker"] for w in answer["workers"]] == ["pod-a"]
                ping = json.loads((await reader.request("$SRV.PING.kv-observe", b"", timeout=5)).data)
                assert ping["name"] == "kv-observe"
                # bad queries get a short error; nothing of them is echoed
                for body in (b"\xff" * (900 * 1024), json.dumps({"chain": ["ab"] * 70_000}).encode(), b"{\r\nX: y"):
                    bad = await reader.request("kvobserve.prefix", body, timeout=5)
                    assert bad.headers is not None and bad.headers["Nats-Service-Error-Code"] == "400"
                    why = bad.headers["Nats-Service-Error"]
                    assert len(why) <= 200 and why.isprintable() and len(bad.data) < 400, (why, len(bad.data))
            finally:
                await reader.close()
            tg.cancel_scope.cancel()
        for operation in ("publish", "subscribe"):
            denied = bridge.metrics.registry.get_sample_value("kvbridge_nats_permission_denied_total",
                                                              {"operation": operation})
            assert not denied, f"the bridge's user was refused a {operation} it needs"
    finally:
        publisher.close()
        server.stop()
