"""`flushed`: once it returns, a subscription just made is live on the
server, so a publish from any other connection reaches it."""

from __future__ import annotations

import nats
import pytest

from bridge.runtime.nats_barrier import flushed
from bridge.runtime.nats_server import NatsServerProcess

pytestmark = pytest.mark.anyio

# With nats-py's own flush() alone, every run of 1,000 rounds here lost
# several (its PING overtakes the SUB still in its pending buffer).
ROUNDS = 1000


async def test_a_subscription_is_live_once_flushed_returns(nats_server: NatsServerProcess) -> None:
    """A fresh connection subscribes (its flusher task has not run yet, the
    race's widest window) and another publishes at once, round after round."""
    writer = await nats.connect(nats_server.url)
    missed: list[int] = []
    try:
        for n in range(ROUNDS):
            reader = await nats.connect(nats_server.url)
            try:
                sub = await reader.subscribe(f"probe.{n}")
                await flushed(reader)
                await writer.publish(f"probe.{n}", b"x")
                await writer.flush()
                try:
                    await sub.next_msg(timeout=1)
                except nats.errors.TimeoutError:
                    missed.append(n)
            finally:
                await reader.close()
    finally:
        await writer.close()
    assert missed == []
