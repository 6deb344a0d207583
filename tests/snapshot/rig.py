"""Pieces of the snapshot tests: a late consumer, and a worker as real
processes (vLLM's wire protocol per rank, `python -m bridge run` for it)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from bridge.apps.demo.workload import HybridWorkload
from bridge.client.connection import BusConnection
from bridge.client.subscribe import BusSubscriber
from bridge.residency import ResidencyIndex
from bridge.runtime.ports import free_port
from tests.busutil import make_settings, rank_publishers
from tests.faults.harness import BridgeProcess, wait_http


@asynccontextmanager
async def late_index(url: str, subject: str = "kv.>", **kwargs: Any) -> AsyncIterator[tuple[ResidencyIndex,
                                                                                          BusSubscriber]]:
    """A consumer that starts now: a BusSubscriber on `subject` (with
    `bootstrap=` or `since=`, as given) feeding a ResidencyIndex. `conn`
    settings (auth) may come as `settings=`."""
    conn = BusConnection()
    settings = kwargs.pop("settings", None) or make_settings(nats_url=[url])
    await conn.open(settings, "late")
    index = ResidencyIndex()
    try:
        async with BusSubscriber(conn, subject, **kwargs) as sub, anyio.create_task_group() as tg:
            async def feed() -> None:
                async for item in sub:
                    index.apply(item)
            tg.start_soon(feed)
            yield index, sub
            tg.cancel_scope.cancel()
    finally:
        await conn.close()


def caught_up(index: ResidencyIndex, worker: str, rank: int, seq: int) -> bool:
    view = index.view(worker, rank)
    return view is not None and view.last_seq == seq


class Worker:
    """A vLLM worker with `ranks` data-parallel ranks (a WirePublisher and a
    HybridWorkload each) and `kv-bridge run` for it, as a subprocess whose
    JSON log goes to a file. `restart()` starts the same bridge again."""

    def __init__(self, tmp: Path, name: str, url: str, *, ranks: int = 1, jetstream: bool = False,
                 extra: tuple[str, ...] = (), seed: int = 3, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.ranks = ranks
        self.tmp = tmp
        pub_port, replay_port, self.pubs = rank_publishers(ranks)
        self.works = [HybridWorkload(seed=seed + r, engine_shapes=True, dp_rank=r if ranks > 1 else None)
                      for r in range(ranks)]
        self.sent = [0] * ranks
        self.http = free_port()
        self.args = ["--zmq-endpoint", f"tcp://127.0.0.1:{pub_port}", "--replay-endpoint",
                     f"tcp://127.0.0.1:{replay_port}", "--dp-ranks", str(ranks), "--nats-url", url,
                     "--worker-id", name, "--http-port", str(self.http), "--http-host", "127.0.0.1",
                     "--drain-timeout", "5", "--log-format", "json", *(["--jetstream"] if jetstream else []), *extra]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
        self.env = {**clean, **(env or {})}
        self.bridges: list[BridgeProcess] = []

    @property
    def bridge(self) -> BridgeProcess:
        return self.bridges[-1]

    async def start(self) -> Worker:
        proc = BridgeProcess(self.args, self.tmp / f"{self.name}-{len(self.bridges)}.log")
        proc.env = self.env
        self.bridges.append(proc.start())
        await wait_http(self.http, timeout=30)
        return self

    def publish(self, batches: int, events: int = 12, clear_at: int | None = None) -> None:
        """`batches` more batches on every rank (a cache clear as batch `clear_at`
        of this call, if given)."""
        for rank, (pub, work) in enumerate(zip(self.pubs, self.works)):
            for i in range(batches):
                pub.publish(work.batch(events, clear=(i == clear_at)))
            self.sent[rank] += batches

    def last_seq(self, rank: int = 0) -> int:
        return self.sent[rank] - 1

    def caught_up(self, index: ResidencyIndex) -> bool:
        return all(caught_up(index, self.name, r, self.last_seq(r)) for r in range(self.ranks))

    def logged(self, event: str, bridge: int = -1) -> list[dict[str, Any]]:
        return [e for e in self.bridges[bridge].logs() if e.get("event") == event]

    async def wait_logged(self, event: str, cond: Callable[[dict[str, Any]], bool] = lambda e: True,
                          timeout: float = 20.0) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [e for e in self.logged(event) if cond(e)]
            return bool(found)

        with anyio.fail_after(timeout):
            while not await anyio.to_thread.run_sync(seen):
                await anyio.sleep(0.1)
        return found[-1]

    def close(self) -> None:
        for proc in self.bridges:
            proc.stop(timeout=15)
        for pub in self.pubs:
            pub.close()
