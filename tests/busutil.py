"""Test helpers: a real bridge in-process, a real subscriber on the bus."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import nats

from bridge.apps.demo.publisher import WirePublisher
from bridge.client.codec import BusCodec
from bridge.contract import GroupMessage, WorkerRecord
from bridge.producer.config import OPTIONS, Settings, load_settings
from bridge.producer.service import Bridge
from bridge.runtime.nats_barrier import flushed
from bridge.runtime.ports import free_port, free_port_run


def make_settings(**overrides: Any) -> Settings:
    """Settings as `kv-bridge run` would build them from flags."""
    ns = argparse.Namespace(**{opt.dest: None for opt in OPTIONS})
    ns.http_host = "127.0.0.1"
    ns.http_port = 0
    ns.worker_id = "test-worker"
    for key, value in overrides.items():
        setattr(ns, key, value)
    return load_settings(ns, {})


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def rank_publishers(ranks: int) -> tuple[int, int, list[WirePublisher]]:
    """(PUB port, replay port, publishers) for `ranks` data-parallel ranks,
    rank r on each port + r as vLLM offsets them."""
    pub_port, replay_port = free_port_run(ranks), free_port_run(ranks)
    pubs: list[WirePublisher] = []
    try:
        for r in range(ranks):
            pubs.append(WirePublisher(f"tcp://*:{pub_port + r}", f"tcp://*:{replay_port + r}"))
    except BaseException:
        for pub in pubs:
            pub.close()
        raise
    return pub_port, replay_port, pubs


@asynccontextmanager
async def running_bridge(settings: Settings) -> AsyncIterator[Bridge]:
    bridge = Bridge(settings)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(bridge.run, stop)
        with anyio.fail_after(15):
            await bridge.ready.wait()
        try:
            yield bridge
        finally:
            stop.set()


class Received(msgspec.Struct):
    subject: str
    headers: dict[str, str]
    body: GroupMessage | WorkerRecord


class BusCollector:
    """Everything on `<prefix>.>`, decoded, in arrival order."""

    def __init__(self, fmt: str = "msgpack") -> None:
        self._fmt = fmt
        self._codec = BusCodec()
        self.wrong_format: list[str] = []
        self.items: list[Received] = []
        self.raw: list[bytes] = []
        self.nc: nats.NATS | None = None

    async def start(self, url: str, subject: str = "kv.>") -> BusCollector:
        self.nc = await nats.connect(url)
        await self.nc.subscribe(subject, cb=self._on_msg)
        await flushed(self.nc)
        return self

    async def _on_msg(self, msg: Any) -> None:
        self.raw.append(msg.data)
        headers = dict(msg.headers or {})
        if self._codec.format_of(msg.data, headers) != self._fmt:
            self.wrong_format.append(msg.subject)
        body = self._codec.decode(msg.subject, headers, msg.data)
        self.items.append(Received(msg.subject, dict(msg.headers or {}), body))

    def groups(self) -> list[GroupMessage]:
        return [r.body for r in self.items if isinstance(r.body, GroupMessage)]

    def records(self, type_: str | None = None) -> list[WorkerRecord]:
        return [r.body for r in self.items if isinstance(r.body, WorkerRecord) and (type_ is None or r.body.type == type_)]

    def seqs(self) -> list[int]:
        """Distinct batch seqs of group messages, in arrival order."""
        out: list[int] = []
        for g in self.groups():
            if not out or out[-1] != g.seq:
                out.append(g.seq)
        return out

    async def wait_for(self, cond: Callable[[BusCollector], bool], timeout: float = 10.0) -> None:
        with anyio.fail_after(timeout):
            while not cond(self):
                await anyio.sleep(0.02)

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.drain()


def metric(bridge: Bridge, name: str, **labels: str) -> float:
    """A sample from the bridge's own Prometheus registry (0 when never set)."""
    value = bridge.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def wait_published(bridge: Bridge, batches: float, timeout: float = 20.0) -> None:
    """Until the bridge has handed `batches` vLLM batches to NATS; TimeoutError otherwise."""
    with anyio.fail_after(timeout):
        while metric(bridge, "kvbridge_batches_out_total") < batches:
            await anyio.sleep(0.05)


async def wait_until(cond: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    """Until `cond()` holds, checked every 20 ms; an AssertionError naming `what` after `timeout`."""
    try:
        with anyio.fail_after(timeout):
            while not cond():
                await anyio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}") from None
