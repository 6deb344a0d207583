"""A slot's log read at once (`SlotLog.live`, which compacts it) and a piece
at a time (`SlotLog.iter_live`, what a snapshot on the event loop reads)
name the same ids, held alone or with other slots, whatever the log repeats."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st

from bridge.residency.slot_logs import SlotLog

IDS = 64


@given(st.lists(st.integers(0, IDS - 1), max_size=300), st.lists(st.integers(0, 5), min_size=IDS, max_size=IDS),
       st.integers(1, 50))
def test_read_at_once_and_in_pieces_name_the_same_ids(log: list[int], column: list[int], pause: int) -> None:
    slot = 1
    # held[i]: 0 nobody, 2*slot+1 this slot alone, an even sid: a holder set (sets[sid] its bitset)
    sets = [0, 0, 0b011, 0, 0b101]
    held = array("q", [0 if c == 0 else 2 * slot + 1 if c == 1 else 1 if c == 3 else [2, 4][c % 2] for c in column])
    cell = SlotLog()
    cell.log = array("I", log)
    pieces = list(cell.iter_live(held, slot, sets, pause))
    ids = [i for i in pieces if i >= 0]
    assert pieces.count(-1) == len(log) // pause
    assert len(ids) == len(set(ids)), "each id once"
    assert ids == list(dict.fromkeys(i for i in log if i in set(ids))), "in the order the log took them"
    assert set(ids) == set(cell.live(held, slot, sets))
