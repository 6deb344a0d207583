"""Worker records and epochs: what invalidates a view, and how."""

from __future__ import annotations

import msgspec

from bridge.client.subscribe import Interruption
from bridge.contract import GroupMessage, WorkerRecord
from bridge.contract.snapshot import SnapshotMissing
from bridge.residency.index import ResidencyIndex
from tests.client.builders import ATTN, STATE, hb, msg, record, removed, stored

CHAIN = [hb(i) for i in range(6)]


def _fed(*items) -> ResidencyIndex:
    index = ResidencyIndex()
    for item in items:
        index.apply(item)
    return index


def _blocks(index: ResidencyIndex, **kw) -> int:
    match = index.match("w", 0, CHAIN, **kw)
    return -1 if match is None else match.blocks


def test_gap_makes_what_was_held_suspect_and_later_stores_trusted() -> None:
    index = _fed(msg([stored(CHAIN[:4])]), record("gap", gap=(5, 9)))
    view = index.view("w", 0)
    assert view is not None and view.stale and view.gaps == 1 and view.lost == [(5, 9)]
    assert _blocks(index) == 0
    assert _blocks(index, include_suspect=True) == 4
    assert index.longest_prefix(CHAIN)[0].stale
    # re-announced after the gap: trusted again, the rest stays suspect
    index.apply(msg([stored(CHAIN[:2])]))
    assert _blocks(index) == 2
    # a removal takes the trusted copy first: block 1 is suspect-only again
    index.apply(msg([removed([CHAIN[1]])]))
    assert _blocks(index) == 1
    assert _blocks(index, include_suspect=True) == 4


def test_cleared_empties_every_group_and_ends_staleness() -> None:
    index = _fed(msg([stored(CHAIN[:4])]), msg([stored([CHAIN[3]], group=STATE)], group=STATE),
                 record("gap", gap=(1, 1)), record("cleared", seq=7))
    view = index.view("w", 0)
    assert view is not None
    assert not view.stale and view.clears == 1
    assert set(view.groups) == {ATTN, STATE}  # structure kept
    assert _blocks(index, include_suspect=True) == 0
    index.apply(msg([removed([CHAIN[0]])]))
    assert view.groups[ATTN].unknown_removals == 1


def test_restart_drops_everything_and_adopts_the_new_epoch() -> None:
    index = _fed(msg([stored(CHAIN[:4])]), msg([stored([CHAIN[3]], group=STATE)], group=STATE),
                 record("restart", epoch=2, seq=0))
    view = index.view("w", 0)
    assert view is not None
    assert view.epoch == 2 and view.restarts == 1 and view.groups == {}
    # a straggler of the old process changes nothing
    index.apply(msg([stored(CHAIN[:4])], epoch=1))
    assert view.groups == {} and view.old_epoch_ignored == 1
    index.apply(msg([stored(CHAIN[:2])], epoch=2))
    assert _blocks(index) == 2


def test_a_newer_epoch_without_a_record_resets_too() -> None:
    index = _fed(msg([stored(CHAIN[:4])]), msg([stored(CHAIN[:1])], epoch=5))
    assert _blocks(index) == 1
    view = index.view("w", 0)
    assert view is not None and view.epoch == 5 and view.restarts == 0
    # what the new process announced before this message never reached us
    assert view.partial and view.stale and index.match("w", 0, CHAIN).stale  # type: ignore[union-attr]


def test_a_partial_view_stays_partial_through_a_clear_until_a_restart_or_fresh_start() -> None:
    """A clear empties the caches, not the view's ignorance: a group it never
    heard of (here an empty state group, which blocks every prefix for the
    consumer that knows it) is still missing from it. Only a record that
    drops the groups too makes it whole."""
    head = [msg([stored(CHAIN[:4])]), msg([stored([CHAIN[3]], group=STATE)], group=STATE)]
    tail: list[GroupMessage | WorkerRecord | SnapshotMissing] = [record("cleared", seq=8), msg([stored(CHAIN[:2])])]
    watcher = _fed(*head, *tail)
    late = ResidencyIndex()
    late.apply(SnapshotMissing("w", 0, "no bridge answers"))
    for item in tail:
        late.apply(item)
    view = late.view("w", 0)
    assert view is not None and view.partial and view.stale
    assert set(view.groups) == {ATTN} and set(watcher.view("w", 0).groups) == {ATTN, STATE}  # type: ignore[union-attr]
    assert _blocks(watcher) == 0 and late.match("w", 0, CHAIN).blocks == 2  # type: ignore[union-attr]
    for reset in (record("restart", epoch=2, seq=0), record("start", reason="fresh")):
        again = ResidencyIndex()
        for item in (SnapshotMissing("w", 0, "none"), *tail, reset):
            again.apply(item)
        assert not again.view("w", 0).partial  # type: ignore[union-attr]
    late.apply(record("start", reason="resumed"))
    assert view.partial


def test_fresh_start_drops_the_view_and_resumed_start_keeps_it() -> None:
    index = _fed(msg([stored(CHAIN[:4])]), record("start", epoch=1, reason="resumed"))
    assert _blocks(index) == 4
    index.apply(record("start", epoch=1, reason="fresh"))
    assert _blocks(index) == 0
    index = _fed(msg([stored(CHAIN[:4])]), record("start", epoch=3))  # no reason: an older bridge, fresh
    assert _blocks(index) == 0


def test_stop_hides_the_worker_until_it_speaks_again() -> None:
    index = _fed(msg([stored(CHAIN[:3])]), record("stop", seq=4))
    assert index.longest_prefix(CHAIN) == []
    assert [m.blocks for m in index.longest_prefix(CHAIN, include_unwatched=True)] == [3]
    index.apply(record("start", reason="resumed"))
    assert [m.blocks for m in index.longest_prefix(CHAIN)] == [3]


def test_records_of_an_older_epoch_are_ignored() -> None:
    index = _fed(msg([stored(CHAIN[:3])], epoch=4), record("gap", epoch=3, gap=(0, 2)),
                 record("cleared", epoch=3), record("restart", epoch=2), record("start", epoch=1))
    view = index.view("w", 0)
    assert view is not None and view.old_epoch_ignored == 4
    assert _blocks(index) == 3 and not view.stale


def test_a_local_interruption_marks_every_worker_stale() -> None:
    index = _fed(msg([stored(CHAIN[:3])], worker="w"), msg([stored(CHAIN[:2])], worker="v"),
                 Interruption("disconnect", 0.0))
    assert index.interruptions == 1
    assert all(m.stale and m.blocks == 0 for m in index.longest_prefix(CHAIN))
    assert sorted(m.blocks for m in index.longest_prefix(CHAIN, include_suspect=True)) == [2, 3]


def test_ranks_are_separate_views() -> None:
    index = _fed(msg([stored(CHAIN[:3])], rank=0), msg([stored(CHAIN[:5])], rank=1), record("cleared", rank=1))
    assert _blocks(index) == 3
    assert index.match("w", 1, CHAIN).blocks == 0  # type: ignore[union-attr]


def test_declared_groups_survive_a_restart() -> None:
    index = ResidencyIndex()
    index.declare("w", 0, STATE, "mamba", 16)
    index.apply(msg([stored(CHAIN[:3])]))
    index.apply(record("restart", epoch=2))
    index.apply(msg([stored(CHAIN[:3])], epoch=2))
    view = index.view("w", 0)
    assert view is not None and STATE in view.groups and view.groups[STATE].block_size == 16
    assert _blocks(index) == 0  # the declared state group has no checkpoint yet


def test_kind_learned_late_updates_the_family() -> None:
    index = _fed(msg([removed([CHAIN[0]], group=STATE)], group=STATE, kind="unknown", source="unknown"))
    view = index.view("w", 0)
    assert view is not None and view.groups[STATE].family == "other"
    index.apply(msg([stored([CHAIN[0]], group=STATE)], group=STATE))
    assert view.groups[STATE].family == "state"


def test_a_message_published_again_is_applied_once() -> None:
    # JetStream mode on a core subscription: the store at seq 5 went out, its
    # ack was late, the removal at seq 6 followed, then the store went again.
    store = msg([stored(CHAIN[:3])], seq=5)
    index = _fed(store, msg([removed([CHAIN[2]])], seq=6), store)
    view = index.view("w", 0)
    assert view is not None and view.duplicates_ignored == 1 and view.messages == 2
    assert _blocks(index) == 2
    # groups are ordered apart: the state group's seq 5 is no copy
    index.apply(msg([stored([CHAIN[2]], group=STATE)], group=STATE, seq=5))
    assert view.duplicates_ignored == 1 and STATE in view.groups


def test_copies_are_told_by_part_and_chunk_within_a_seq() -> None:
    first = msgspec.structs.replace(msg([stored(CHAIN[:1])], seq=3), chunk=0, chunks=2)
    second = msgspec.structs.replace(msg([stored(CHAIN[1:2])], seq=3), chunk=1, chunks=2)
    after_clear = msgspec.structs.replace(msg([stored(CHAIN[:1])], seq=3), part=1)
    index = _fed(first, second, first, after_clear, second)
    view = index.view("w", 0)
    assert view is not None and view.duplicates_ignored == 2 and view.messages == 3
    # a new epoch starts the order again
    index.apply(msg([stored(CHAIN[:2])], epoch=2, seq=0))
    assert _blocks(index) == 2 and view.duplicates_ignored == 2
