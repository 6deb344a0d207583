"""The core-NATS splice against a real nats-server, with a bridge stand-in
that controls what is on the wire: the messages a snapshot holds may still
wait in the subscription's queue when the snapshot's answer is read. They
must be cut like the ones already buffered, records included (a `cleared`
applied again after the snapshot would empty the view, and every store
after it is then ignored as a copy: a view silently short of its blocks)."""

from __future__ import annotations

from typing import Any

import msgspec
import nats
import pytest

from bridge.client.bootstrap import BootstrapOptions, splice_buffer
from bridge.contract import HDR_MSG_ID
from bridge.contract.snapshot import SnapshotMissing, encode_part, encode_snapshot, snapshot_subject, split
from bridge.producer.sink.encode import MessageEncoder, Outgoing
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import wait_until
from tests.client.builders import hi, msg, record, stored
from tests.snapshot.rig import caught_up, late_index
from tests.snapshot.views import index_state

pytestmark = pytest.mark.anyio

WORKER = "pod-x"


class FakeBridge:
    """Publishes contract messages for one rank as the bridge does (its
    encoder, subjects and ids), keeps them with the bridge's keeper, and
    answers snapshot requests; `on_request` runs before each answer."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.keeper = ResidencyKeeper(WORKER)
        self.encoder = MessageEncoder("msgpack")
        self.book = SubjectBook("kv", WORKER, 0)
        self.seq = 0
        self.burst = 0

    async def publish(self, out: Outgoing) -> None:
        await self.nc.publish(out.subject, out.payload, headers=out.headers)
        self.keeper.published([out])

    async def stores(self, n: int) -> None:
        for _ in range(n):
            self.seq += 1
            group = msg([stored([hi(self.seq), hi(self.seq + 100_000)])], worker=WORKER, seq=self.seq)
            await self.publish(self.encoder.group(group, self.book, f"{WORKER}:1"))

    async def cleared(self) -> None:
        rec = record("cleared", worker=WORKER, seq=self.seq)
        await self.publish(self.encoder.record(rec, self.book, f"{WORKER}:1:cleared:{self.seq}"))

    async def answer(self, req: Any) -> None:
        # A burst the snapshot holds, its last message right before the answer:
        # all of it reaches the consumer before the answer does.
        await self.stores(self.burst)
        await self.cleared()
        await self.stores(self.burst)
        self.keeper.catch_up()
        snap = self.keeper.snapshot(0)
        assert snap is not None
        (part,) = split(snap, encode_snapshot(snap), "s1", 1 << 20)
        await self.nc.publish(req.reply, encode_part(part))


async def test_what_the_snapshot_holds_is_cut_even_when_still_queued(nats_server: NatsServerProcess) -> None:
    nc = await nats.connect(nats_server.url)
    fake = FakeBridge(nc)
    fake.burst = 400
    await nc.subscribe(snapshot_subject("kv", WORKER, 0), cb=fake.answer)
    try:
        await fake.stores(20)
        # No bridge answers $SRV.INFO here: the rank is known only from what
        # reaches the buffer while discovery runs, so discovery is given long
        # enough for that on a busy machine (0.3 s once was not, in CI).
        async with late_index(nats_server.url, bootstrap=BootstrapOptions(discover_s=2.0)) as (late, sub):
            # in the buffer while discovery runs: the rank is asked for
            await fake.stores(5)
            await nc.flush()
            await wait_until(lambda: len(sub.sources) == 1, 20, "the bootstrap")
            await fake.stores(5)
            await nc.flush()
            fake.keeper.catch_up()
            await wait_until(lambda: caught_up(late, WORKER, 0, fake.seq), 10, "the late consumer")
            assert [s.source for s in sub.sources] == ["service"]
            # what a consumer that watched from the start holds: the keeper's own index

            assert index_state(late) == index_state(fake.keeper.index)
            view = late.view(WORKER, 0)
            assert view is not None and view.duplicates_ignored == 0
    finally:
        await nc.close()


class _Item:
    def __init__(self, body: object, msg_id: str) -> None:
        self.body = body
        self.headers = {HDR_MSG_ID: msg_id}


def test_an_older_snapshot_without_its_message_in_the_buffer_is_missing_what_came_between() -> None:
    """splice_buffer with `older` ranks (bucket snapshots in core mode)."""
    keeper = ResidencyKeeper(WORKER)
    group = msg([stored([hi(1)])], worker=WORKER, seq=1)
    keeper.index.apply(group)
    snap = keeper.index.snapshot(WORKER, 0, through="id-1")
    assert snap is not None
    later = _Item(msg([stored([hi(2)])], worker=WORKER, seq=2), "id-2")
    key = (WORKER, 0)
    # the snapshot's message is in the buffer: cut there, nothing missing
    out = splice_buffer([_Item(group, "id-1"), later], {key: snap}, older={key})
    assert out == [snap, later]
    # it is not: what came between the snapshot and the subscription is not known
    out = splice_buffer([later], {key: snap}, older={key})
    assert out[0] is snap and type(out[1]) is SnapshotMissing and out[2] is later
    # unless the snapshot's bridge had stopped (nothing came after its last message)
    stopped = msgspec.structs.replace(snap, watching=False)
    assert splice_buffer([later], {key: stopped}, older={key}) == [stopped, later]
    # the service's snapshot is the latest: nothing to say
    assert splice_buffer([later], {key: snap}) == [snap, later]
