"""The ZMQ side's receive loop: drain, wait once, and coalesce a fast trickle."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest
import zmq

from bridge.producer.source import zmq_io
from bridge.producer.source.subscriber import Subscriber
from bridge.producer.source.zmq_io import InputWatch


async def _forward(sub: Subscriber, send: anyio.abc.ObjectSendStream[list[list[bytes]]]) -> None:
    chunks: AsyncIterator[list[list[bytes]]] = sub.batches()
    async for messages in chunks:
        await send.send(messages)


async def _next(receive: anyio.abc.ObjectReceiveStream[list[list[bytes]]]) -> list[bytes]:
    with anyio.fail_after(10):
        return [parts[-1] for parts in await receive.receive()]


async def _quiet(receive: anyio.abc.ObjectReceiveStream[list[list[bytes]]], seconds: float) -> None:
    """Throw away whatever comes for `seconds` (the probes sent while the SUB joined)."""
    with anyio.move_on_after(seconds):
        while True:
            await receive.receive()


@asynccontextmanager
async def _wired(coalesce: float, watch: InputWatch | None = None,
                 ) -> AsyncIterator[tuple[zmq.Socket[bytes], anyio.abc.ObjectReceiveStream[list[list[bytes]]]]]:
    """A PUB socket and what a Subscriber on it yields, once the subscription
    has arrived (PUB drops until then: probes go until one comes through)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = Subscriber(ctx, f"tcp://127.0.0.1:{port}", "", 1000, coalesce_s=coalesce, watch=watch)
    send, receive = anyio.create_memory_object_stream[list[list[bytes]]](100)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_forward, sub, send)
            with anyio.fail_after(10):
                while True:
                    pub.send_multipart([b"", b"probe"])
                    with anyio.move_on_after(0.05):
                        await receive.receive()
                        break
            await _quiet(receive, max(2 * coalesce, 0.3))
            yield pub, receive
            tg.cancel_scope.cancel()
    finally:
        sub.close()
        pub.close(linger=0)
        ctx.term()


@pytest.mark.anyio
async def test_a_fast_trickle_is_taken_in_one_chunk_and_a_slow_stream_one_by_one() -> None:
    async with _wired(coalesce=0.3) as (pub, receive):
        # A stream quieter than the coalescing window: each batch on its own.
        pub.send_multipart([b"", b"a"])
        assert await _next(receive) == [b"a"]
        # The next one comes within the window: it is taken at once, and
        # then the subscriber waits for more before taking again.
        pub.send_multipart([b"", b"b"])
        assert await _next(receive) == [b"b"]
        burst = [f"c{i}".encode() for i in range(10)]
        for payload in burst:
            pub.send_multipart([b"", payload])
        assert await _next(receive) == burst


@pytest.mark.anyio
async def test_without_coalescing_every_batch_is_taken_as_it_comes() -> None:
    async with _wired(coalesce=0.0) as (pub, receive):
        for i in range(5):
            pub.send_multipart([b"", f"m{i}".encode()])
            assert await _next(receive) == [f"m{i}".encode()]


@pytest.mark.anyio
async def test_the_input_watch_sees_a_waiting_batch_and_leaves_the_subscriber_its_wakeup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The idle snapshot keeper asks the watch between pieces of its work, on
    # the loop, while the subscriber waits on its socket's FD. Asking must
    # not take the edge the subscriber waits for: with the safety net's bound
    # a minute long, a subscriber whose edge was taken would not wake in time.
    monkeypatch.setattr(zmq_io.wait_readable, "__defaults__", (60.0,))
    watch = InputWatch()
    async with _wired(coalesce=0.0, watch=watch) as (pub, receive):
        assert not watch.waiting()
        pub.send_multipart([b"", b"x"])
        seen = 0
        for _ in range(5000):  # the loop held, as the keeper holds it: nobody reads meanwhile
            if watch.waiting():
                seen += 1
                if seen == 3:  # asked again: still there
                    break
            else:
                time.sleep(0.001)
        assert seen == 3
        assert await _next(receive) == [b"x"]
        await anyio.sleep(0.05)
        assert not watch.waiting()  # read: nothing waits any more
