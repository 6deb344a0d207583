"""Data-parallel ranks on offset ports; the bounded queue's drop-oldest policy."""

from __future__ import annotations

import time
from typing import cast

import pytest
import zmq

from bridge.apps.demo.wire_writer import encode_batch, stored
from bridge.contract import GroupMessage
from bridge.producer.service import BODIES_QUEUED_AT_MOST, Bridge
from bridge.producer.sink.encode import Outgoing
from bridge.producer.sink.queue import BatchQueue, LostRange, OutBatch
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import BusCollector, make_settings, rank_publishers, running_bridge


@pytest.mark.anyio
async def test_each_dp_rank_has_its_own_subjects_and_seq(nats_server: NatsServerProcess) -> None:
    port, rport, pubs = rank_publishers(2)
    settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{port}"], replay_endpoint=[f"tcp://127.0.0.1:{rport}"],
                             dp_ranks="2", nats_url=[nats_server.url], worker_id="w")
    bus = await BusCollector().start(nats_server.url)
    try:
        async with running_bridge(settings):
            for i in range(6):
                for rank, pub in enumerate(pubs):
                    pub.publish(encode_batch(time.time(), [stored([bytes([rank, i]) * 16], None, [], 16, group_idx=0,
                                                                  kind="full_attention")], rank))
            await bus.wait_for(lambda b: len(b.groups()) == 12)
    finally:
        for pub in pubs:
            pub.close()
        await bus.close()
    by_subject: dict[str, list[int]] = {}
    for r in bus.items:
        if not r.subject.endswith(".worker"):
            assert isinstance(r.body, GroupMessage)
            by_subject.setdefault(r.subject, []).append(r.body.seq)
            assert cast(bytes, r.body.events[0].block_hashes[0])[0] == r.body.dp_rank  # published as bytes
    assert by_subject == {"kv.w.0": list(range(6)), "kv.w-dp1.0": list(range(6))}


def _batch(seq: int, stream: int = 0) -> OutBatch:
    return OutBatch(stream, 1, seq, 0.0, [Outgoing("s", b"", {}, "attention", 1)])


def test_full_queue_drops_oldest_and_announces_the_range_first() -> None:
    made: list[LostRange] = []

    def make_gap(lost: LostRange) -> OutBatch:
        made.append(lost)
        return OutBatch(lost.stream, lost.epoch, -1, 0.0, [Outgoing("gap", b"", {}, "worker", 0)])

    drops: list[int] = []
    q = BatchQueue(3, make_gap, lambda: drops.append(1))
    record = OutBatch(0, 1, -1, 0.0, [Outgoing("rec", b"", {}, "worker", 0)])
    q.put(record)
    for seq in range(6):
        q.put(_batch(seq))
    # records are never dropped; batches 0..3 went, oldest first
    assert q.dropped == 4 and len(drops) == 4
    order = []
    while (item := q.peek()) is not None:
        order.append(item.messages[0].subject if item.seq < 0 else item.seq)
        q.pop()
    assert order == ["gap", "rec", 4, 5]
    assert [(m.first, m.last) for m in made] == [(0, 3)]


def test_byte_bound_drops_the_oldest_batches_and_announces_them() -> None:
    """Large batches bound the queue by bytes long before by count: memory stays
    within --max-buffered-bytes (plus the batch being added), losses are named."""
    made: list[LostRange] = []

    def make_gap(lost: LostRange) -> OutBatch:
        made.append(lost)
        return OutBatch(lost.stream, lost.epoch, -1, 0.0, [Outgoing("gap", b"", {}, "worker", 0)])

    def big(seq: int) -> OutBatch:
        return OutBatch(0, 1, seq, 0.0, [Outgoing("s", b"x" * 3000, {}, "attention", 1, b"h" * 100)])

    q = BatchQueue(1000, make_gap, max_bytes=10_000)
    for seq in range(3):
        q.put(big(seq))
    assert not q.full() and q.bytes == 9_300 and q.dropped == 0
    q.put(big(3))
    assert q.full() and q.bytes == 12_400 and q.dropped == 0  # over by the newest batch only
    q.put(big(4))
    q.put(big(5))
    assert q.dropped == 2 and q.bytes <= 10_000 + 3_100
    seqs = []
    while (item := q.peek()) is not None:
        seqs.append(item.seq)
        q.pop()
    assert seqs == [-1, 2, 3, 4, 5] and [(g.first, g.last) for g in made] == [(0, 1)]
    assert q.bytes == 0 and not q.full()


def test_batches_carry_their_structs_for_the_keeper_only_while_the_queue_is_short() -> None:
    """A queue that grows is a burst: its batches hold payloads alone, not
    the objects they encode, and the keeper decodes them again."""
    bridge = Bridge(make_settings(zmq_endpoint="tcp://127.0.0.1:5557"))
    assert bridge._keeper_takes_bodies()
    # a batch waiting in ZMQ: the relay runs behind vLLM
    ctx = zmq.Context()
    try:
        recv, send = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        recv.bind("inproc://bodies")
        send.connect("inproc://bodies")
        bridge._input.add(recv)
        send.send(b"batch")
        time.sleep(0.05)
        assert not bridge._keeper_takes_bodies()
        recv.recv()
        assert bridge._keeper_takes_bodies()
        bridge._input.remove(recv)
    finally:
        ctx.destroy(linger=0)
    for seq in range(BODIES_QUEUED_AT_MOST + 1):
        bridge.queue.put(_batch(seq))
    assert not bridge._keeper_takes_bodies()
    assert not Bridge(make_settings(zmq_endpoint="tcp://127.0.0.1:5557", snapshots=False))._keeper_takes_bodies()
