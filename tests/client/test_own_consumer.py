"""Reading a stream through consumers of one's own name (bridge.client.consumer),
and the one rule every consumer applies to reply-subject copies
(bridge.contract.identity.reply_copy), on a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import nats
import pytest
from nats.aio.msg import Msg
from nats.js import api

from bridge.client.consumer import CONSUMERS_PER_USER, ConsumerNamesInUse, OwnConsumer, consumer_names, consumer_user
from bridge.client.registry import RegistryFollower
from bridge.contract import GroupInfo, RankInfo, WorkerEntry, encode_entry
from bridge.contract.identity import STORED_HEADERS, Refusal, reply_copy
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.producer.snapshot.rebuild import replayed
from bridge.runtime.nats_server import NatsServerProcess
from tests.client.builders import hb, msg, stored

pytestmark = pytest.mark.anyio


async def _stream(url: str, inbox: str = "_INBOX.reader") -> nats.NATS:
    nc = await nats.connect(url, inbox_prefix=inbox)
    await nc.jetstream().add_stream(api.StreamConfig(name="S", subjects=["kv.>"], allow_direct=True))
    return nc


async def _take(it: AsyncIterator[Msg], n: int) -> list[int]:
    out = []
    with anyio.fail_after(20):
        async for m in it:
            out.append(int(m.data))
            if len(out) == n:
                break
    return out


def test_the_user_comes_from_the_inbox_prefix() -> None:
    assert consumer_user("_INBOX.reader") == "reader"
    assert consumer_user("_INBOX.bridge-a.x") == "bridge-a"
    assert consumer_user("_INBOX") is None


async def test_a_client_of_no_user_gets_a_consumer_name_of_its_own(nats_server: NatsServerProcess) -> None:
    named = await nats.connect(nats_server.url, inbox_prefix="_INBOX.reader")
    shared = await nats.connect(nats_server.url)
    try:
        assert consumer_names(named) == [f"kvr-reader-{n}" for n in range(CONSUMERS_PER_USER)]
        first, second = consumer_names(shared), consumer_names(shared)
        assert len(first) == 1 and first[0].startswith("kvr-") and "." not in first[0]
        assert first != second, "each call names a consumer no other client has"
    finally:
        await named.close()
        await shared.close()


async def test_every_message_once_in_order_across_a_lost_consumer(nats_server: NatsServerProcess) -> None:
    nc = await _stream(nats_server.url)
    js = nc.jetstream()
    try:
        for i in range(300):
            await js.publish("kv.a.0", str(i).encode())
        consumer = OwnConsumer(nc, "S", api.ConsumerConfig(filter_subject="kv.>"))
        await consumer.start()
        assert consumer.name == "kvr-reader-0"
        it = consumer.messages()
        first = await _take(it, 100)
        # The consumer goes (an admin, the server's inactivity rule): the
        # reader makes it again after the last stream sequence it saw.
        await js.delete_consumer("S", "kvr-reader-0")
        for i in range(300, 400):
            await js.publish("kv.a.0", str(i).encode())
        rest = await _take(it, 300)
        assert first + rest == list(range(400))
        assert consumer.recreated >= 1
        await consumer.stop()
        assert [c.name async for c in _consumers(js)] == []
    finally:
        await nc.close()


async def _consumers(js: nats.js.JetStreamContext) -> AsyncIterator[api.ConsumerInfo]:
    for info in await js.consumers_info("S"):
        yield info


async def test_a_name_in_use_is_skipped_never_taken_over(nats_server: NatsServerProcess) -> None:
    nc = await _stream(nats_server.url)
    js = nc.jetstream()
    try:
        await js.publish("kv.a.0", b"1")
        held = []
        for _ in range(CONSUMERS_PER_USER):
            c = OwnConsumer(nc, "S", api.ConsumerConfig(filter_subject="kv.a.>"))
            await c.start()
            held.append(c)
        assert [c.name for c in held] == [f"kvr-reader-{n}" for n in range(CONSUMERS_PER_USER)]
        extra = OwnConsumer(nc, "S", api.ConsumerConfig(filter_subject="kv.b.>"))
        with pytest.raises(ConsumerNamesInUse):
            await extra.start()
        # None of the held ones was changed to the extra one's filter.
        assert {(await js.consumer_info("S", c.name or "")).config.filter_subject for c in held} == {"kv.a.>"}
        for c in held:
            await c.stop()
    finally:
        await nc.close()


async def test_a_reply_copy_is_refused_by_the_rule_the_follower_and_the_rebuild(
        nats_server: NatsServerProcess) -> None:
    nc = await _stream(nats_server.url)
    js = nc.jetstream()
    try:
        # As the bridge makes its buckets: direct gets allowed.
        await js.add_stream(api.StreamConfig(name="KV_w", subjects=["$KV.w.>"], max_msgs_per_subject=1,
                                             allow_direct=True, deny_delete=True))
        kv = await js.key_value("w")
        entry = WorkerEntry(worker="b", ranks=[RankInfo(0)], groups=[GroupInfo(0, "full_attention", "attention")],
                            started_at=1.0, heartbeat_ts=2.0, heartbeat_interval=5.0)
        await kv.put("b", encode_entry(entry))
        follower = RegistryFollower(nc, "w")
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run)
            with anyio.fail_after(10):
                await follower.loaded.wait()
            assert "b" in follower.entries
            # A delete marker, read back onto b's key: KV-Operation DEL with the server's headers.
            await kv.delete("gone")
            await nc.publish("$JS.API.DIRECT.GET.KV_w.$KV.w.gone", b"", reply="$KV.w.b")
            with anyio.fail_after(10):
                while not follower.identity.refused[Refusal.REPLY_COPY]:
                    await anyio.sleep(0.02)
            assert follower.entries["b"].worker == "b"
            # An API answer onto b's key: JSON that is no entry.
            await nc.publish("$JS.API.STREAM.INFO.KV_w", b"", reply="$KV.w.b")
            with anyio.fail_after(10):
                while not follower.bad_entries:
                    await anyio.sleep(0.02)
            assert follower.entries["b"].worker == "b"
            tg.cancel_scope.cancel()
        assert follower.identity.refused == {Refusal.REPLY_COPY: 1} and follower.bad_entries == 1

        # The rebuild: a's own message, copied back onto a's subject by a direct get.
        enc = MessageEncoder("msgpack")
        out = enc.group(msg([stored([hb(1)])], worker="a", seq=0), SubjectBook("kv", "a", 0), "a:0:1:0")
        await js.publish(out.subject, out.payload, headers=dict(out.headers))
        answer = await nc.request(f"$JS.API.DIRECT.GET.S.{out.subject}", b"")
        assert reply_copy(answer.headers) and STORED_HEADERS <= set(answer.headers or {}) | {"Nats-Last-Sequence"}
        assert not reply_copy(dict(out.headers))
        keeper = ResidencyKeeper("a", ranks=(0,))
        assert not replayed(keeper, 0, dict(answer.headers or {}), answer.data, 2, out.subject)
        assert keeper.refused == {Refusal.REPLY_COPY: 1}
    finally:
        await nc.close()
