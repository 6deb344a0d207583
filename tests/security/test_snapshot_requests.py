"""What a snapshot request may cost the bridge that answers it (docs/security.md,
"Requests cannot hurt the server that answers them"): asking again while
nothing new was applied gets the same snapshot (no new encoding of the
rank), anything new gets a new one; a request whose reply subject is no
inbox gets no answer; an oversize or malformed request gets a short error,
and the bridge goes on."""

from __future__ import annotations

import json

import anyio
import nats
import nats.aio.msg
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.contract.snapshot import decode_part
from bridge.runtime.nats_barrier import flushed
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import endpoints, make_settings, metric, running_bridge, wait_published
from tests.faults.harness import fault_batch

pytestmark = pytest.mark.anyio

SUBJECT = "kvbridge.snapshot.kv.test-worker"


async def test_asking_again_costs_no_new_snapshot(nats_server: NatsServerProcess) -> None:
    pub_ep, replay_ep = endpoints()
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url])
    publisher = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    nc = await nats.connect(nats_server.url)
    try:
        async with running_bridge(settings) as bridge:
            for k in range(5):
                publisher.publish(fault_batch(0, k))
            await wait_published(bridge, 5)

            async def part0() -> str:
                return decode_part((await nc.request(SUBJECT, b"", timeout=5)).data).id

            first = await part0()
            assert await part0() == first, "nothing new applied: the same snapshot"
            for k in range(5, 8):
                publisher.publish(fault_batch(0, k))
            await wait_published(bridge, 8)
            assert await part0() != first, "new messages: a new snapshot"

            # a reply subject that is no inbox: nothing answered, nothing written there
            got: list[bytes] = []

            async def on_msg(msg: nats.aio.msg.Msg) -> None:
                got.append(msg.data)

            sub = await nc.subscribe("not.an.inbox", cb=on_msg)
            await nc.publish(SUBJECT, b"", reply="not.an.inbox")
            await flushed(nc)
            await anyio.sleep(0.5)
            assert got == []
            await sub.unsubscribe()

            for body, code in ((json.dumps({"id": "y" * 100_000}).encode(), "400"), (b"[1,", "400"),
                               (json.dumps({"id": "\r\n" + "z" * 300, "part": 3}).encode(), "404")):
                msg = await nc.request(SUBJECT, body, timeout=5)
                assert msg.headers is not None and msg.headers["Nats-Service-Error-Code"] == code
                why = msg.headers["Nats-Service-Error"]
                assert len(why) <= 200 and why.isprintable(), why
            assert metric(bridge, "kvbridge_snapshot_requests_total", result="bad_request") >= 3
            publisher.publish(fault_batch(0, 8))
            await wait_published(bridge, 9)
    finally:
        publisher.close()
        await nc.close()
