"""A residency index fed from a real nats-server, for end-to-end tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio

from bridge.client.connection import BusConnection
from bridge.client.subscribe import BusSubscriber
from bridge.residency.index import ResidencyIndex
from tests.busutil import make_settings


@asynccontextmanager
async def live_index(url: str, subject: str = "kv.>") -> AsyncIterator[ResidencyIndex]:
    conn = BusConnection()
    await conn.open(make_settings(nats_url=[url]), "test-index")
    index = ResidencyIndex()

    async def feed(sub: BusSubscriber) -> None:
        async for item in sub:
            index.apply(item)

    try:
        async with BusSubscriber(conn, subject) as sub, anyio.create_task_group() as tg:
            tg.start_soon(feed, sub)
            yield index
            tg.cancel_scope.cancel()
    finally:
        await conn.close()


async def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.02)
