"""The keeper applies a long message in pieces, and nobody sees half of one.

An idle slice of the keeper ends after about half a millisecond, but a
message of hundreds of events takes longer than that to apply: it is applied
`step_events` events at a time (fewer with the Python loop than the native one), and what reads the keeper's residency (a
snapshot, a rebuild, a shed) finds every message whole."""

from __future__ import annotations

import pytest

from bridge.contract import GroupMessage
from bridge.contract.msgid import stream_base
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import NATIVE_STEP_EVENTS, STEP_EVENTS, ResidencyKeeper
from bridge.residency.cells import NATIVE_CELL, Cell, CellLike, PyCell
from tests.client.builders import hi, msg, removed, stored
from tests.snapshot.views import snapshot_state

WORKER = "pod-steps"
EPOCH = 3
LONG = 10 * max(STEP_EVENTS, NATIVE_STEP_EVENTS) + 5  # events in one message: at least eleven pieces


def _messages() -> list[GroupMessage]:
    first = msg([stored([hi(i)]) for i in range(LONG)], worker=WORKER, epoch=EPOCH, seq=1)
    second = msg([removed([hi(i)]) for i in range(0, LONG, 2)] + [stored([hi(LONG + 1)])],
                 worker=WORKER, epoch=EPOCH, seq=2)
    return [first, second]


def _keeper(messages: list[GroupMessage], cell: type[CellLike] = Cell) -> ResidencyKeeper:
    keeper = ResidencyKeeper(WORKER, ranks=(0,), cell=cell)
    encoder, subjects = MessageEncoder("msgpack"), SubjectBook("kv", WORKER, 0)
    base = stream_base(WORKER, 0, EPOCH)
    keeper.published([encoder.group(m, subjects, f"{base}:{m.seq}:0") for m in messages])
    return keeper


def _held(keeper: ResidencyKeeper) -> tuple[str, list[object]]:
    snap = keeper.snapshot(0)
    assert snap is not None
    return snapshot_state(snap)


@pytest.mark.parametrize("cell", [Cell, PyCell], ids=["native-or-fallback", "python"])
def test_a_long_message_is_applied_in_pieces_to_the_same_residency(cell: type[CellLike]) -> None:
    whole = _keeper(_messages(), cell)
    assert whole.catch_up() == 2
    pieces = _keeper(_messages(), cell)
    slices = 0
    while pieces.pending:
        # A slice this short ends at the first pause: one piece of a message per call.
        pieces.catch_up(seconds=1e-9)
        slices += 1
        assert slices < 100
    assert slices > LONG // pieces.step_events  # the first message took more than one slice
    assert pieces.applied == whole.applied
    assert _held(pieces) == _held(whole)


@pytest.mark.parametrize("cell", [NATIVE_CELL, PyCell], ids=["native", "python"])
def test_pieces_are_longer_for_the_native_loop(cell: type[CellLike] | None) -> None:
    if cell is None:
        pytest.skip("the native module was not built")
    keeper = _keeper(_messages()[:1], cell)
    step = NATIVE_STEP_EVENTS if cell is NATIVE_CELL else STEP_EVENTS
    assert keeper.step_events == step
    slices = 0
    while keeper.pending:
        keeper.catch_up(seconds=1e-9)
        slices += 1
    assert slices == -(-LONG // step)


def test_a_message_applied_in_part_is_finished_before_anyone_reads() -> None:
    whole = _keeper(_messages()[:1])
    whole.catch_up()
    keeper = _keeper(_messages())
    assert keeper.catch_up(seconds=1e-9) == 0  # the first message, in part
    assert keeper.pending == 2  # the one in part counts
    # A snapshot names the message whole, not the events applied so far.
    assert _held(keeper) == _held(whole)
    assert keeper.pending == 1
    view = keeper.index.view(WORKER, 0)
    assert view is not None and view.messages == 1


def test_a_shed_finishes_the_message_in_part_before_the_ranks_lose_their_view() -> None:
    keeper = _keeper(_messages())
    keeper.catch_up(seconds=1e-9)
    keeper.shed()  # the rest of the log goes
    view = keeper.index.view(WORKER, 0)
    assert view is not None and view.partial
    # Every block the first message stored is in the view (suspect now): none was cut off.
    group = view.groups[0]
    assert sum(group.trusted["GPU"].values()) + sum(group.suspect["GPU"].values()) == LONG


@pytest.mark.anyio
async def test_an_export_waits_for_no_piece_and_names_the_whole_message() -> None:
    whole = _keeper(_messages()[:1])
    whole.catch_up()
    keeper = _keeper(_messages())
    keeper.catch_up(seconds=1e-9)
    taken = await keeper.export(0)
    assert taken is not None
    snap, _ = taken
    assert snap.through == _held(whole)[0]
    assert sum(len(tier.trusted) for g in snap.groups for tier in g.tiers) == LONG
