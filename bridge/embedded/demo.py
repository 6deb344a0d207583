"""`kv-bridge demo`: a hybrid-model publisher in vLLM's wire format, the bridge,
a local nats-server and a live subscriber, in one process tree, no GPU."""

from __future__ import annotations

import sys
from typing import TextIO

import anyio
import msgspec
import nats
import structlog
from nats.aio.msg import Msg

from bridge.client.codec import BusCodec
from bridge.config import Settings
from bridge.contract import WorkerRecord
from bridge.embedded.nats_server import NatsServerProcess, free_port
from bridge.service import Bridge
from bridge.testing.publisher import WirePublisher
from bridge.testing.workload import HybridWorkload
from bridge.tools.render import render_group, render_record

log = structlog.get_logger("bridge.demo")


async def _feed(pub: WirePublisher, batches: int, interval: float, events_per_batch: int) -> None:
    workload = HybridWorkload(seed=7, engine_shapes=True)
    for i in range(batches):
        pub.publish(workload.batch(events_per_batch, clear=(i + 1) % 40 == 0))
        await anyio.sleep(interval)


async def run_demo(settings: Settings, batches: int, interval: float, events_per_batch: int,
                   out: TextIO = sys.stdout) -> int:
    """`settings` come from the same flags as `run`; the ZMQ and NATS ends are
    replaced by the demo's own."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    with NatsServerProcess() as server:
        settings = msgspec.structs.replace(
            settings, zmq_endpoint=[endpoint], replay_endpoint=[replay], nats_url=[server.url], dp_ranks=1,
        )
        out.write(f"demo: nats-server {server.url}, vLLM-format publisher {endpoint} (replay {replay})\n")
        out.write(f"demo: subjects {settings.subject_prefix}.>  (another shell: kv-bridge tail --nats-url {server.url})\n")
        out.flush()
        bridge = Bridge(settings)
        stop = anyio.Event()
        pub = WirePublisher(endpoint, replay)
        nc = await nats.connect(server.url)
        codec = BusCodec()

        async def show(msg: Msg) -> None:
            body = codec.decode(msg.subject, msg.headers, msg.data)
            line = render_record(body) if isinstance(body, WorkerRecord) else render_group(body)
            out.write(f"{msg.subject:<28} {line}\n")
            out.flush()

        await nc.subscribe(f"{settings.subject_prefix}.>", cb=show)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(bridge.run, stop)
                await bridge.ready.wait()
                await _feed(pub, batches, interval, events_per_batch)
                await anyio.sleep(0.5)
                stop.set()
            await nc.flush()
            await anyio.sleep(0.2)
        finally:
            await nc.drain()
            pub.close()
    out.write(f"demo: done, {batches} batches published through the bridge\n")
    return 0
