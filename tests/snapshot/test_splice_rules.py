"""The splice rules of a late consumer's bootstrap (bridge.client.bootstrap):
what a snapshot covers is skipped, what follows it is applied, and a rank
without a snapshot is marked before its first item, never left silently
partial. (test_property.py runs them on random histories; these are the
cases by name.)"""

from __future__ import annotations

from bridge.client.bootstrap import Found, LiveGate, RankKey, splice_buffer, stream_opening
from bridge.client.subscribe import BusMessage
from bridge.contract import GroupMessage, WorkerRecord
from bridge.contract.snapshot import RankSnapshot, SnapshotMissing
from tests.client.builders import hb, msg, record, stored


def _item(body: GroupMessage | WorkerRecord, msg_id: str, stream_seq: int | None = None) -> BusMessage:
    return BusMessage("kv.w.0", {"Nats-Msg-Id": msg_id}, body, 1.0, stream_seq)


def _snap(rank: int, through: str, stream_seq: int = 0) -> RankSnapshot:
    return RankSnapshot(v=1, worker="w", dp_rank=rank, epoch=1, taken_at=1.0, through=through, stream_seq=stream_seq)


def test_the_buffer_is_cut_after_the_message_the_snapshot_names() -> None:
    a, b, c = (_item(msg([stored([hb(i)])], seq=i), f"w:0:1:{i}:0") for i in range(3))
    snap = _snap(0, "w:0:1:1:0")
    assert splice_buffer([a, b, c], {("w", 0): snap}) == [snap, c]
    # a snapshot of what came before the subscription cuts nothing
    older = _snap(0, "w:0:1:0:0")
    assert splice_buffer([b, c], {("w", 0): older}) == [older, b, c]


def test_a_rank_the_buffer_shows_but_no_fetch_covered_is_marked_before_its_first_item() -> None:
    """Its first message came after the last fetch round: from the middle of
    its history (marked), or with a record that resets it (not marked, and
    not marked later either)."""
    snap = _snap(0, "w:0:1:5:0")
    mid = _item(msg([stored([hb(1)])], rank=1, seq=9), "w-dp1:1:1:9:0")
    gate = LiveGate({("w", 0): snap})
    out = splice_buffer([mid], {("w", 0): snap}, gate=gate)
    assert len(out) == 3 and out[0] is snap and out[2] is mid
    assert out[1] == SnapshotMissing("w", 1, "first seen after the bootstrap")
    assert gate.admit(mid.body, None) == (None, True)  # known now: nothing more

    fresh = _item(record("start", rank=1, epoch=2, reason="fresh"), "w-dp1:1:2:t1:worker:start")
    gate = LiveGate({("w", 0): snap})
    assert splice_buffer([fresh, mid], {("w", 0): snap}, gate=gate) == [snap, fresh, mid]
    assert gate.admit(mid.body, None) == (None, True)


def test_the_stream_is_read_from_the_oldest_snapshot_on_each_rank_skipping_its_own() -> None:
    found: dict[RankKey, Found] = {("w", 0): _snap(0, "a", stream_seq=10), ("w", 1): _snap(1, "b", stream_seq=4)}
    plan = stream_opening(found, first_seq=3)
    assert plan.items == [found[("w", 0)], found[("w", 1)]] and plan.start_seq == 5
    gate = LiveGate(found, plan.skip_seq)
    body = msg([stored([hb(1)])])
    assert gate.admit(body, 10) == (None, False)  # rank 0's snapshot holds it
    assert gate.admit(body, 11) == (None, True)


def test_a_stream_that_rolled_past_a_snapshot_marks_the_rank() -> None:
    snap = _snap(0, "a", stream_seq=10)
    plan = stream_opening({("w", 0): snap, ("w", 1): SnapshotMissing("w", 1, "none")}, first_seq=20)
    assert plan.items == [snap, SnapshotMissing("w", 0, "the stream no longer holds what followed the snapshot"),
                          SnapshotMissing("w", 1, "none")]
    assert plan.start_seq == 20
    assert stream_opening({("w", 0): SnapshotMissing("w", 0, "none")}, first_seq=20).start_seq is None


def test_a_partial_views_answers_are_stale() -> None:
    """A rank with no snapshot: routers see its answers flagged stale, from
    every query path, until a record resets it."""
    from bridge.residency import ResidencyIndex

    index = ResidencyIndex()
    index.apply(msg([stored([hb(1), hb(2)])], seq=1))
    assert [m.stale for m in index.longest_prefix([hb(1), hb(2)])] == [False]  # caches the flags
    index.apply(SnapshotMissing("w", 0, "no bridge answers"))
    assert [m.stale for m in index.longest_prefix([hb(1), hb(2)])] == [True]
    assert index.match("w", 0, [hb(1)]).stale  # type: ignore[union-attr]
    index.apply(record("start", reason="fresh", epoch=2))
    assert [m.stale for m in index.longest_prefix([hb(1)])] == [False]
