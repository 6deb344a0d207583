"""`flushed`: once it returns, a subscription just made is live on the
server, so a publish from any other connection reaches it."""

from __future__ import annotations

import anyio
import nats
import pytest
from nats.aio.msg import Msg

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


async def test_it_covers_a_publish_still_in_nats_pys_buffer(nats_server: NatsServerProcess) -> None:
    """What a connection published before `flushed` is on the server when it
    returns: a subscriber that was already there has it, in order."""
    reader = await nats.connect(nats_server.url)
    writer = await nats.connect(nats_server.url)
    got: list[bytes] = []
    try:
        async def on_msg(msg: Msg) -> None:
            got.append(msg.data)

        await reader.subscribe("order", cb=on_msg)
        await flushed(reader)
        for n in range(50):
            await writer.publish("order", str(n).encode())
        await flushed(writer)
        with anyio.fail_after(10):
            while len(got) < 50:
                await anyio.sleep(0.01)
    finally:
        await reader.close()
        await writer.close()
    assert got == [str(n).encode() for n in range(50)]
