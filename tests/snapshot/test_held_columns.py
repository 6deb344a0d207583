"""A rank's tier as a snapshot lists it (`held_columns`): the per-rank tables
copy their dicts out a slice at a time, and must list exactly what reading
them entry by entry lists (`from_copies` over `held_copies`, the fleet's
way), in the same order, whatever mix of trusted, suspect and placeholder
copies a history of stores, removals and gaps left."""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from bridge.residency import rank_tables
from bridge.residency.cells import Cell, CellLike, PyCell
from bridge.residency.fleet import FleetResidency
from bridge.residency.held_columns import HeldColumns, from_copies
from bridge.residency.rank_tables import PLACEHOLDER, RankTables
from bridge.residency.slots import WorkerKey

_T = TypeVar("_T")
GPU = "GPU"

# (op, hashes): a store, a placeholder store, a removal, or a gap (demote).
_ops = st.lists(
    st.tuples(st.sampled_from(["store", "mark", "remove", "demote"]),
              st.lists(st.integers(0, 40), min_size=1, max_size=6)),
    max_size=40,
)


def _run(steps: Generator[None, None, _T]) -> tuple[_T, int]:
    pauses = 0
    while True:
        try:
            next(steps)
            pauses += 1
        except StopIteration as done:
            return done.value, pauses


def _fed(store: RankTables | FleetResidency, ops: list[tuple[str, list[int]]]) -> int:
    slot = store.add_slot(WorkerKey("w", 0))
    for op, hashes in ops:
        if op == "store":
            store.store(slot, 0, GPU, list(hashes))
        elif op == "mark":
            store.store(slot, 0, GPU, list(hashes), placeholder=True)
        elif op == "remove":
            store.remove(slot, 0, GPU, list(hashes))
        else:
            store.demote(slot, 0)
    return slot


@pytest.mark.parametrize("cell", [Cell, PyCell], ids=["cell", "pycell"])
@settings(max_examples=300, deadline=None)
@given(ops=_ops)
def test_the_tables_list_what_reading_them_entry_by_entry_lists(cell: type[CellLike],
                                                                ops: list[tuple[str, list[int]]]) -> None:
    tables = RankTables(cell)
    slot = _fed(tables, ops)
    entry_by_entry, _ = _run(from_copies(tables.held_copies(slot, 0, GPU),
                                         tables.layer_items(slot, 0, GPU, PLACEHOLDER)))
    with pytest.MonkeyPatch.context() as mp:
        # Slices of three: every pause between two copies and two lookups is taken.
        mp.setattr(rank_tables, "COPY_STEP", 3)
        mp.setattr(rank_tables, "LOOKUP_STEP", 3)
        sliced, _ = _run(tables.held_columns(slot, 0, GPU))
    assert sliced == entry_by_entry
    whole, _ = _run(tables.held_columns(slot, 0, GPU))
    assert whole == entry_by_entry


@settings(max_examples=100, deadline=None)
@given(_ops)
def test_both_stores_hold_the_same_copies(ops: list[tuple[str, list[int]]]) -> None:
    """The fleet lists a tier in its log's order: the same hashes and copies."""
    tables, fleet = RankTables(), FleetResidency()
    a, b = _fed(tables, ops), _fed(fleet, ops)
    mine, _ = _run(tables.held_columns(a, 0, GPU))
    theirs, _ = _run(fleet.held_columns(b, 0, GPU))

    def copies(c: HeldColumns) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
        def layer(hashes: list[int], n: list[int]) -> dict[int, int]:
            return dict(zip(hashes, n or [1] * len(hashes)))
        return (layer(c.trusted, c.trusted_copies), layer(c.suspect, c.suspect_copies),  # type: ignore[arg-type]
                layer(c.placeholders, c.placeholder_copies))  # type: ignore[arg-type]

    assert copies(mine) == copies(theirs)


def test_a_large_tier_pauses_between_slices_and_leaves_out_ones() -> None:
    tables = RankTables()
    slot = tables.add_slot(WorkerKey("w", 0))
    n = 3 * rank_tables.COPY_STEP + 5
    tables.store(slot, 0, GPU, list(range(n)))
    cols, pauses = _run(tables.held_columns(slot, 0, GPU))
    assert cols.trusted == list(range(n))
    assert cols.trusted_copies == []  # every count is one: left out, as snapshots carry it
    assert pauses >= 3
    tables.store(slot, 0, GPU, [7])
    cols, _ = _run(tables.held_columns(slot, 0, GPU))
    assert cols.trusted_copies[7] == 2 and len(cols.trusted_copies) == n
