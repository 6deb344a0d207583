"""A write of one batch, while the relay is idle, is applied at once; so is a
message the stream stored (JetStream mode) when its ack comes back.

At a steady load the relay writes one batch at a time and is idle until the
next: the keeper applies that batch right after the write (in JetStream
mode, each message as its ack hands it over) instead of waking later for
it. A write of several batches means the relay fell behind, a busy relay
has work in hand, and a keeper that already has a log to apply (or a
snapshot to export) is in the middle of its own work: in each case the
write waits in the log for `keep_up`, which applies only in the relay's idle
moments and lets the log go when it cannot keep up."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest

from bridge.apps.demo.wire_writer import encode_batch
from bridge.apps.demo.wire_writer import stored as wire_stored
from bridge.contract import GroupMessage
from bridge.contract.msgid import stream_base
from bridge.contract.snapshot import RankSnapshot
from bridge.producer.sink.encode import MessageEncoder, Outgoing
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import make_settings, rank_publishers, running_bridge, wait_published, wait_until
from tests.client.builders import hi, msg, removed, stored
from tests.snapshot.sim import Stream
from tests.snapshot.test_keeper_yields import Relay
from tests.snapshot.views import snapshot_state

WORKER = "pod-at-once"
EPOCH = 4


def _writes(n: int) -> list[list[Outgoing]]:
    """`n` batches, each one group message, as the sink hands them over."""
    encoder, subjects = MessageEncoder("msgpack"), SubjectBook("kv", WORKER, 0)
    base = stream_base(WORKER, 0, EPOCH)
    out = []
    for seq in range(1, n + 1):
        m: GroupMessage = msg([stored([hi(seq), hi(seq + 1000)]), removed([hi(seq - 1)])],
                              worker=WORKER, epoch=EPOCH, seq=seq)
        out.append([encoder.group(m, subjects, base, keep_body=seq % 2 == 0)])
    return out


def _keeper(relay: Relay) -> ResidencyKeeper:
    return ResidencyKeeper(WORKER, ranks=(0,), relay_busy=relay)


def _held(keeper: ResidencyKeeper) -> tuple[str, list[object]]:
    snap = keeper.snapshot(0)
    assert snap is not None
    return snapshot_state(snap)


def _applied_later(writes: list[list[Outgoing]]) -> ResidencyKeeper:
    keeper = _keeper(Relay(busy=False))
    for messages in writes:
        keeper.published(messages)
    keeper.catch_up()
    return keeper


def test_one_batch_written_while_the_relay_is_idle_is_applied_at_once() -> None:
    writes = _writes(6)
    keeper = _keeper(Relay(busy=False))
    for messages in writes:
        keeper.published(messages, 1)
        assert keeper.pending == 0, "applied right after its write"
    assert keeper.log_bytes == 0
    later = _applied_later(writes)
    assert keeper.applied == later.applied
    assert _held(keeper) == _held(later)


@pytest.mark.parametrize("batches", [0, 2, 5], ids=["not-known", "two", "five"])
def test_a_write_of_several_batches_waits_for_the_idle_keeper(batches: int) -> None:
    keeper = _keeper(Relay(busy=False))
    keeper.published(_writes(1)[0], batches)
    assert keeper.pending == 1


def test_a_write_while_the_relay_has_work_in_hand_waits() -> None:
    relay = Relay(busy=False)
    keeper = _keeper(relay)
    writes = _writes(3)
    relay.busy = True
    keeper.published(writes[0], 1)
    assert keeper.pending == 1
    relay.busy = False
    # The log is the keeper's own work now: what follows it waits behind it.
    keeper.published(writes[1], 1)
    assert keeper.pending == 2
    keeper.catch_up()
    keeper.published(writes[2], 1)
    assert keeper.pending == 0
    assert _held(keeper) == _held(_applied_later(writes))


def test_a_message_applied_in_part_keeps_the_next_write_waiting() -> None:
    keeper = _keeper(Relay(busy=False))
    long = msg([stored([hi(i)]) for i in range(3 * keeper.step_events)], worker=WORKER, epoch=EPOCH, seq=1)
    encoder, subjects = MessageEncoder("msgpack"), SubjectBook("kv", WORKER, 0)
    base = stream_base(WORKER, 0, EPOCH)
    keeper.published([encoder.group(long, subjects, base)])
    keeper.catch_up(seconds=1e-9)
    assert keeper.pending == 1  # in part
    nxt = msg([removed([hi(0)])], worker=WORKER, epoch=EPOCH, seq=2)
    keeper.published([encoder.group(nxt, subjects, base)], 1)
    assert keeper.pending == 2


@pytest.mark.anyio
async def test_nothing_is_applied_at_once_while_a_snapshot_is_exported() -> None:
    relay = Relay(busy=False)
    keeper = _keeper(relay)
    writes = _writes(2)
    keeper.published(writes[0], 1)
    before = _held(keeper)
    relay.busy = True  # the export waits for an idle moment of the relay
    async with anyio.create_task_group() as tg:
        taken: list[tuple[RankSnapshot, bytes] | None] = []

        async def export() -> None:
            taken.append(await keeper.export(0))

        tg.start_soon(export)
        await anyio.sleep(0.01)
        assert keeper.exporting
        relay.busy = False
        keeper.published(writes[1], 1)
        assert keeper.pending == 1, "the export reads the residency: the write waits"
    exported = taken[0]
    assert exported is not None
    assert snapshot_state(exported[0]) == before
    keeper.catch_up()
    assert _held(keeper) == _held(_applied_later(writes))


def _one_store(i: int) -> bytes:
    """A vLLM batch of one attention store, hash `i`."""
    return encode_batch(time.time(), [wire_stored([bytes([i]) * 32], None, [], 16, group_idx=0,
                                                  kind="full_attention")], 0)


@pytest.mark.anyio
async def test_the_bridge_hands_each_write_over_with_its_batch_count(nats_server: NatsServerProcess,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A real bridge: batches that come one at a time are applied as each is
    written; every hand-over names how many batches its write held."""
    seen: list[tuple[int, int]] = []  # (write_batches, pending right after)
    published = ResidencyKeeper.published

    def spy(self: ResidencyKeeper, messages: list[Outgoing], write_batches: int = 0) -> None:
        published(self, messages, write_batches)
        seen.append((write_batches, self.pending))

    monkeypatch.setattr(ResidencyKeeper, "published", spy)
    port, rport, pubs = rank_publishers(1)
    settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{port}"], replay_endpoint=[f"tcp://127.0.0.1:{rport}"],
                             nats_url=[nats_server.url], worker_id=WORKER)
    try:
        async with running_bridge(settings) as bridge:
            for i in range(8):
                pubs[0].publish(_one_store(i))
                await wait_published(bridge, i + 1)
                await anyio.sleep(0.02)
            trickled = len(seen)
            for i in range(8, 60):
                pubs[0].publish(_one_store(i))
            await wait_published(bridge, 60)
            assert bridge.keeper is not None
            await wait_until(lambda: bridge.keeper is not None and not bridge.keeper.pending, 10, "the keeper")
            assert bridge.keeper.applied[0] == 61  # the start record and 60 stores
    finally:
        pubs[0].close()
    # One at a time: each write held one batch, applied before the next came.
    assert seen[:trickled] == [(1, 0)] * trickled
    # A write of k batches is k hand-overs in a row, each saying k.
    i = 0
    while i < len(seen):
        k = seen[i][0]
        assert k >= 1 and [w for w, _ in seen[i:i + k]] == [k] * k, seen
        i += k


def test_a_message_stored_while_the_relay_is_idle_is_applied_at_once() -> None:
    """JetStream mode: each message as its ack hands it over, the snapshot
    naming the stream sequence a reader goes on from."""
    writes = _writes(6)
    keeper = _keeper(Relay(busy=False))
    for seq, messages in enumerate(writes, start=1):
        keeper.stored(messages[0], Stream.ack(seq, False))
        assert keeper.pending == 0, "applied when its ack came"
        snap = keeper.snapshot(0)
        assert snap is not None and snap.stream_seq == seq
    assert _held(keeper) == _held(_applied_later(writes))


def test_a_stored_message_waits_while_the_relay_is_busy_or_the_keeper_has_a_log() -> None:
    relay = Relay(busy=True)
    keeper = _keeper(relay)
    writes = _writes(3)
    keeper.stored(writes[0][0], Stream.ack(1, False))
    assert keeper.pending == 1
    relay.busy = False
    keeper.stored(writes[1][0], Stream.ack(2, False))
    assert keeper.pending == 2, "behind the log: in stream order, after it"
    keeper.catch_up()
    keeper.stored(writes[2][0], Stream.ack(3, False))
    assert keeper.pending == 0
    snap = keeper.snapshot(0)
    assert snap is not None and snap.stream_seq == 3
    assert _held(keeper) == _held(_applied_later(writes))


@pytest.mark.anyio
async def test_the_jetstream_bridge_applies_each_message_as_the_stream_stores_it(
        nats_server: NatsServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real bridge and stream: batches that come one at a time are applied
    as their acks come back, none left for the keeper to wake for."""
    seen: list[int] = []  # pending right after each hand-over
    hand_over = ResidencyKeeper.stored

    def spy(self: ResidencyKeeper, msg: Outgoing, ack: bytes) -> None:
        hand_over(self, msg, ack)
        seen.append(self.pending)

    def handed_over(n: int) -> Callable[[], bool]:
        return lambda: len(seen) >= n

    monkeypatch.setattr(ResidencyKeeper, "stored", spy)
    port, rport, pubs = rank_publishers(1)
    settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{port}"], replay_endpoint=[f"tcp://127.0.0.1:{rport}"],
                             nats_url=[nats_server.url], worker_id=WORKER + "-js", jetstream=True)
    try:
        async with running_bridge(settings) as bridge:
            await wait_until(handed_over(1), 10, "the start record stored")
            for i in range(8):
                pubs[0].publish(_one_store(i))
                await wait_until(handed_over(i + 2), 10, "the batch stored")
                await anyio.sleep(0.02)
            assert bridge.keeper is not None and bridge.keeper.applied[0] == 9  # the start record and 8 stores
    finally:
        pubs[0].close()
    assert seen[1:9] == [0] * 8
