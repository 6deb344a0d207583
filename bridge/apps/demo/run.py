"""`kv-bridge demo`: a hybrid-model publisher in vLLM's wire format, the bridge,
a local nats-server and a live subscriber, in one process tree, no GPU.

With `workers` > 1: that many simulated hybrid workers, each with its own
publisher and its own bridge (worker id `<worker_id>-<i>`, HTTP port
`http_port + i` unless 0), all into one nats-server; pairs of workers replay
the same requests, so the fleet holds hashes on more than one worker; a
batch in 100 is lost live and replayed."""

from __future__ import annotations

import hashlib
import sys
import time
from typing import TextIO

import anyio
import msgspec
import nats
import structlog
from nats.aio.msg import Msg

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.wire_writer import encode_batch, stored
from bridge.apps.demo.workload import BLOCK_SIZE, MAMBA, HybridWorkload
from bridge.apps.render import render_group, render_record
from bridge.client.codec import BusCodec
from bridge.contract import BlockHash, WorkerRecord
from bridge.producer.config import Settings
from bridge.producer.service import Bridge
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port

log = structlog.get_logger("bridge.demo")


async def _feed(pub: WirePublisher, batches: int, interval: float, events_per_batch: int, seed: int = 7,
                fleet: bool = False) -> None:
    """`fleet` (more than one worker): also what a fleet meets now and then, so
    every panel of both dashboards has something: one batch in 100 lost on the
    way (the bridge replays it) and one in 50 an offloaded mamba chunk listing
    every block (the bridge keeps its one checkpoint, the last)."""
    workload = HybridWorkload(seed=seed, engine_shapes=True)
    for i in range(batches):
        pub.publish(workload.batch(events_per_batch, clear=(i + 1) % 40 == 0), drop=fleet and i % 100 == 99)
        if fleet and i % 50 == 25:
            pub.publish(_wide_state_batch(seed, i))
        await anyio.sleep(interval)


def _wide_state_batch(seed: int, i: int) -> bytes:
    hashes: list[BlockHash] = [hashlib.sha256(f"demo-state-{seed}-{i}-{k}".encode()).digest() for k in range(2)]
    return encode_batch(time.time(), [stored(hashes, None, [], BLOCK_SIZE, medium="CPU", group_idx=MAMBA, kind="mamba")])


async def run_demo(settings: Settings, batches: int, interval: float, events_per_batch: int,
                   out: TextIO = sys.stdout, workers: int = 1, quiet: bool = False) -> int:
    """`settings` come from the same flags as `run`; the ZMQ and NATS ends are
    replaced by the demo's own. `quiet`: no line per message."""
    if workers < 1:
        raise ValueError("workers must be at least 1")
    with NatsServerProcess() as server:
        bridges: list[Bridge] = []
        pubs: list[WirePublisher] = []
        for i in range(workers):
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            replay = f"tcp://127.0.0.1:{free_port()}"
            overrides: dict[str, object] = {}
            if workers > 1:
                overrides["worker_id"] = f"{settings.worker_id}-{i}"
                if settings.http_port:
                    overrides["http_port"] = settings.http_port + i
            mine = msgspec.structs.replace(
                settings, zmq_endpoint=[endpoint], replay_endpoint=[replay], nats_url=[server.url], dp_ranks=1,
                **overrides,
            )
            out.write(f"demo: nats-server {server.url}, vLLM-format publisher {endpoint} (replay {replay})\n"
                      if workers == 1 else
                      f"demo: worker {mine.worker_id}: vLLM-format publisher {endpoint} (replay {replay})\n")
            bridges.append(Bridge(mine))
            pubs.append(WirePublisher(endpoint, replay))
        if workers > 1:
            out.write(f"demo: {workers} workers into nats-server {server.url}\n")
        out.write(f"demo: subjects {settings.subject_prefix}.>  (another shell: kv-bridge tail --nats-url {server.url})\n")
        out.flush()
        stop = anyio.Event()
        nc = await nats.connect(server.url)
        codec = BusCodec()

        async def show(msg: Msg) -> None:
            body = codec.decode(msg.subject, msg.headers, msg.data)
            line = render_record(body) if isinstance(body, WorkerRecord) else render_group(body)
            out.write(f"{msg.subject:<28} {line}\n")
            out.flush()

        if not quiet:
            await nc.subscribe(f"{settings.subject_prefix}.>", cb=show)
        try:
            async with anyio.create_task_group() as tg:
                for bridge in bridges:
                    tg.start_soon(bridge.run, stop)
                for bridge in bridges:
                    await bridge.ready.wait()
                    if workers > 1 or quiet:
                        out.write(f"demo: bridge {bridge.settings.worker_id} metrics "
                                  f"http://{bridge.settings.http_host}:{bridge.http_port}/metrics\n")
                out.flush()
                async with anyio.create_task_group() as feeders:
                    for i, pub in enumerate(pubs):
                        feeders.start_soon(_feed, pub, batches, interval, events_per_batch, 7 + i // 2, workers > 1)
                await anyio.sleep(0.5)
                stop.set()
            await nc.flush()
            await anyio.sleep(0.2)
        finally:
            await nc.drain()
            for pub in pubs:
                pub.close()
    out.write(f"demo: done, {batches} batches published through the bridge"
              + (f" of each of {workers} workers\n" if workers > 1 else "\n"))
    return 0
