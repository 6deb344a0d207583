"""The sink's two ways through nats-py: the fast path on the pinned nats-py,
the public-API path on any other (or when asked for). Both deliver every batch,
in order, with the same messages, in core and JetStream mode."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import nats
import nats.js.errors
import pytest
import structlog

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.contract import GroupMessage, WorkerRecord
from bridge.producer.config import Settings
from bridge.producer.service import Bridge
from bridge.producer.sink.nats_fastpath import (
    FastPath,
    PublicPath,
    fastpath_problem,
    missing_internals,
    select_path,
)
from bridge.runtime.nats_barrier import flushed
from bridge.runtime.nats_py import PINNED_NATS_PY, installed_nats_py
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import BusCollector, endpoints, make_settings, metric, wait_published

pytestmark = pytest.mark.anyio

BATCHES = 120


def test_the_pinned_nats_py_is_installed_and_gets_the_fast_path() -> None:
    """requirements/ci.txt pins the nats-py the fast path was written against,
    so CI (and every other test of the sink) runs the fast path."""
    assert installed_nats_py() == PINNED_NATS_PY
    assert missing_internals() == []
    assert fastpath_problem() is None
    with structlog.testing.capture_logs() as logs:
        assert isinstance(select_path(), FastPath)
    assert [(e["event"], e["path"]) for e in logs] == [("nats_write_path", "fast")]
    assert Bridge(make_settings(zmq_endpoint=["tcp://127.0.0.1:1"])).sink.write_path == "fast"


def test_another_nats_py_gets_the_public_path_and_one_line_says_why() -> None:
    problem = fastpath_problem("2.17.0")
    assert problem is not None and "2.17.0" in problem and PINNED_NATS_PY in problem
    with structlog.testing.capture_logs() as logs:
        path = select_path(installed="2.17.0")
    assert isinstance(path, PublicPath)
    assert len(logs) == 1 and logs[0]["event"] == "nats_write_path" and logs[0]["path"] == "public"
    assert logs[0]["log_level"] == "warning" and "2.17.0" in logs[0]["reason"]


def test_the_public_path_can_be_asked_for() -> None:
    with structlog.testing.capture_logs() as logs:
        assert isinstance(select_path(fast=False), PublicPath)
    assert [(e["event"], e["path"], e["log_level"]) for e in logs] == [("nats_write_path", "public", "info")]
    bridge = Bridge(make_settings(zmq_endpoint=["tcp://127.0.0.1:1"]), nats_fast_path=False)
    assert bridge.sink.write_path == "public"


class _Bare:
    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass


def test_every_private_name_the_fast_path_uses_is_checked() -> None:
    missing = missing_internals(client_type=_Bare, transport_type=_Bare, subscription_type=_Bare)
    assert set(missing) == {
        "Client._send_command", "Client._flush_pending", "Client._process_msg", "Client._flush_queue",
        "Client._pending_data_size", "Client._pending", "Client._transport", "Client._ps", "Parser.buf", "Parser.state",
        "TcpTransport._io_writer", "Subscription._id",
    }


@asynccontextmanager
async def _bridge(settings: Settings, fast: bool) -> AsyncIterator[Bridge]:
    bridge = Bridge(settings, nats_fast_path=fast)
    assert bridge.sink.write_path == ("fast" if fast else "public")
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(bridge.run, stop)
        with anyio.fail_after(15):
            await bridge.ready.wait()
        try:
            yield bridge
        finally:
            stop.set()


def _shape(groups: list[GroupMessage]) -> list[tuple[int, int, str, int]]:
    """What a consumer reads, less what differs between two bridge runs (epoch, timestamps)."""
    return [(g.seq, g.group, g.family, len(g.events)) for g in groups]


async def _core_run(url: str, fast: bool) -> tuple[list[int], list[tuple[int, int, str, int]], list[str]]:
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep, replay_ep)
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[url])
    collector = await BusCollector().start(url)
    workload = HybridWorkload(seed=11)
    try:
        async with _bridge(settings, fast) as bridge:
            for i in range(BATCHES):
                pub.publish(workload.batch(12 if i % 10 else 200))
            await wait_published(bridge, BATCHES)
        await collector.wait_for(lambda c: bool(c.records("stop")))
    finally:
        pub.close()
        await collector.close()
    return collector.seqs(), _shape(collector.groups()), [r.type for r in collector.records()]


async def test_core_mode_delivers_every_batch_in_order_on_both_paths(nats_server: NatsServerProcess) -> None:
    fast_seqs, fast_groups, fast_records = await _core_run(nats_server.url, fast=True)
    public_seqs, public_groups, public_records = await _core_run(nats_server.url, fast=False)
    assert fast_seqs == public_seqs == list(range(BATCHES))
    assert public_groups == fast_groups
    assert public_records == fast_records == ["start", "stop"]


async def _stream(url: str) -> list[tuple[str, GroupMessage | WorkerRecord]]:
    nc = await nats.connect(url)
    js = nc.jetstream()
    info = await js.stream_info("KV_EVENTS")
    out: list[tuple[str, GroupMessage | WorkerRecord]] = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg("KV_EVENTS", seq)
        assert raw.subject is not None and raw.data is not None
        type_: type[GroupMessage | WorkerRecord] = WorkerRecord if raw.subject.endswith(".worker") else GroupMessage
        out.append((raw.subject, msgspec.msgpack.decode(raw.data, type=type_)))
    await nc.close()
    return out


async def _jetstream_run(fast: bool, **overrides: str) -> list[tuple[str, GroupMessage | WorkerRecord]]:
    with NatsServerProcess(jetstream=True) as server:
        pub_ep, replay_ep = endpoints()
        pub = WirePublisher(pub_ep, replay_ep)
        settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[server.url],
                                 jetstream=True, **overrides)
        workload = HybridWorkload(seed=12)
        try:
            async with _bridge(settings, fast) as bridge:
                for i in range(BATCHES):
                    pub.publish(workload.batch(12 if i % 10 else 200))
                await wait_published(bridge, BATCHES)
                with anyio.fail_after(10):
                    while bridge.sink.in_flight() != (0, 0):
                        await anyio.sleep(0.02)
                assert metric(bridge, "kvbridge_js_refused_total") == 0
        finally:
            pub.close()
        return await _stream(server.url)


@pytest.mark.parametrize("max_pending", ["16384", "64"])
async def test_jetstream_mode_stores_every_batch_once_in_order_on_both_paths(max_pending: str) -> None:
    """Also through a 64-message ack window, so acks are waited for by the
    public path's subscription as by the fast path's parser."""
    runs = {fast: await _jetstream_run(fast, js_max_pending=max_pending) for fast in (True, False)}
    for contents in runs.values():
        groups = [b for _, b in contents if isinstance(b, GroupMessage)]
        seqs = [g.seq for g in groups]
        assert seqs == sorted(seqs) and set(seqs) == set(range(BATCHES))
        assert len({(g.seq, g.group, g.part, g.chunk) for g in groups}) == len(groups)  # none stored twice
    shapes = {fast: _shape([b for _, b in c if isinstance(b, GroupMessage)]) for fast, c in runs.items()}
    assert shapes[False] == shapes[True]


def _gaps(contents: list[tuple[str, GroupMessage | WorkerRecord]]) -> list[tuple[int | None, int | None, str | None]]:
    return [(r.gap_from, r.gap_to, r.reason) for _, r in contents if isinstance(r, WorkerRecord) and r.type == "gap"]


async def test_the_public_path_reads_refusals_and_no_stream_answers_like_the_fast_path(
    nats_server: NatsServerProcess,
) -> None:
    """A refusal (an error PubAck) and a no-stream answer (an inline 503
    status) reach the ack window through the public path's subscription: the
    refused batch is given up and named by a gap, the deleted stream made again."""
    nc = await nats.connect(nats_server.url)
    await nc.jetstream().add_stream(name="KV_EVENTS", subjects=["kv.>"], max_msg_size=8192, allow_direct=True)
    await nc.close()
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep, replay_ep)
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             jetstream=True)
    workload = HybridWorkload(seed=3)
    try:
        async with _bridge(settings, fast=False) as bridge:
            for size in (2, 2, 512, 2, 2):
                pub.publish(workload.batch(size))
            await wait_published(bridge, 5)
            with anyio.fail_after(20):
                while not (gaps := _gaps(contents := await _stream(nats_server.url))):
                    await anyio.sleep(0.05)
            assert gaps == [(2, 2, "refused")]
            assert metric(bridge, "kvbridge_gaps_total", reason="refused") == 1
            assert {0, 1, 3, 4} <= {b.seq for _, b in contents if isinstance(b, GroupMessage)}
            nc = await nats.connect(nats_server.url)
            await nc.jetstream().delete_stream("KV_EVENTS")
            await nc.close()
            for _ in range(3):
                pub.publish(workload.batch(4))
            await wait_published(bridge, 8)
            with anyio.fail_after(20):
                while True:
                    try:
                        stored = {b.seq for _, b in await _stream(nats_server.url) if isinstance(b, GroupMessage)}
                    except nats.js.errors.APIError:  # no stream yet, or one still empty
                        stored = set()
                    if {5, 6, 7} <= stored:
                        break
                    await anyio.sleep(0.1)
    finally:
        pub.close()


async def test_a_disconnect_takes_the_sinks_frames_back_out_of_nats_pys_buffer(nats_server: NatsServerProcess) -> None:
    """nats-py sends its pending buffer to the next server before it tells
    the sink it reconnected: the sink's frames left there would be stored
    ahead of the older ones the lost socket took. drop_pending takes back
    exactly the sink's frames; anything else nats-py holds still goes out."""
    from bridge.producer.sink.encode import Outgoing

    path = FastPath()
    nc = path.new_client()
    await nc.connect(nats_server.url)
    seen: list[str] = []
    reader = await nats.connect(nats_server.url)
    try:
        async def on_msg(msg: Any) -> None:
            seen.append(msg.subject)

        await reader.subscribe(">", cb=on_msg)
        await flushed(reader)
        # something of nats-py's waiting in its buffer: the sink's write queues behind it
        await nc._send_command(b"PUB other.subject 1\r\nx\r\n")  # noqa: SLF001
        await path.write(nc, [Outgoing("kv.w.0", b"payload", {"Nats-Msg-Id": "w:0"}, "attention", 1)], None)
        assert path.drop_pending(nc) > 0
        assert path.drop_pending(nc) == 0
        await nc.flush()
        await path.write(nc, [Outgoing("kv.w.1", b"payload", {"Nats-Msg-Id": "w:1"}, "attention", 1)], None)
        await nc.flush()
        with anyio.fail_after(10):
            while len(seen) < 2:
                await anyio.sleep(0.02)
        await anyio.sleep(0.1)
        assert seen == ["other.subject", "kv.w.1"]
    finally:
        await reader.close()
        await nc.close()


async def test_writes_are_refused_while_nats_py_is_not_connected(nats_server: NatsServerProcess) -> None:
    """A frame written while nats-py is not connected would wait in its
    buffer and reach the next server first: both paths refuse it (the sink
    retries once connected)."""
    from bridge.producer.sink.encode import Outgoing

    for path in (FastPath(), PublicPath()):
        nc = path.new_client()
        await nc.connect(nats_server.url)
        await nc.close()
        with pytest.raises(nats.errors.ConnectionClosedError):
            await path.write(nc, [Outgoing("kv.w.0", b"p", {}, "attention", 1)], None)


async def test_acks_gathered_while_the_socket_rests_all_arrive_and_reading_resumes(
        nats_server: NatsServerProcess) -> None:
    """After a read of nothing but acks the fast path leaves the socket
    unread a moment (BridgeClient.gather_acks): every ack still reaches the
    window, in order, and what is not an ack (a PONG, another
    subscription's message) still arrives once reading resumes."""
    from bridge.producer.sink.encode import Outgoing
    from bridge.producer.sink.nats_fastpath import ACK_GATHER_S, BridgeClient

    admin = await nats.connect(nats_server.url)
    path = FastPath()
    nc = path.new_client()
    await nc.connect(nats_server.url)
    assert isinstance(nc, BridgeClient)
    try:
        await admin.jetstream().add_stream(name="GATHER", subjects=["gather.>"])
        acked: list[int] = []
        paused = 0
        real_gather = nc.gather_acks

        def gather() -> None:
            nonlocal paused
            paused += 1
            real_gather()

        nc.gather_acks = gather  # type: ignore[method-assign]
        inbox = nc.new_inbox()
        await path.route_acks(nc, inbox, lambda subject, data, _: acked.append(int(subject.rsplit(b".", 1)[1])))
        others: list[bytes] = []

        async def on_other(msg: Any) -> None:
            others.append(msg.data)

        await nc.subscribe("other", cb=on_other)
        await flushed(nc)
        n = 60
        for i in range(n):
            msg = Outgoing(f"gather.{i % 3}", b"x", {"Nats-Msg-Id": f"g:{i}"}, "attention", 1)
            await path.write(nc, [msg], [f"{inbox}.{i}"])
            if i % 10 == 9:
                # acks come back one read at a time: the socket rests after each
                await anyio.sleep(ACK_GATHER_S * 3)
                await admin.publish("other", str(i).encode())
        with anyio.fail_after(10):
            await nc.flush()  # the PONG comes through a resting socket too
            while len(acked) < n or len(others) < n // 10:
                await anyio.sleep(0.01)
        assert acked == list(range(n))
        assert others == [str(i).encode() for i in range(9, n, 10)]
        assert paused > 0
        assert (await admin.jetstream().stream_info("GATHER")).state.messages == n
    finally:
        await nc.close()
        await admin.close()
