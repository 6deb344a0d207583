"""The hybrid prefix rule on hand-built cases, one constraint at a time."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge.contract import ATTENTION
from bridge.contract import STATE as STATE_FAMILY
from bridge.contract import WINDOW as WINDOW_FAMILY
from bridge.residency.index import ResidencyIndex
from bridge.residency.prefix import allowed_at, group_limit, window_blocks
from tests.client.builders import ATTN, OTHER_G, STATE, WIN, hb, hi, msg, removed, stored

CHAIN = [hb(i) for i in range(8)]


def _index(*messages) -> ResidencyIndex:
    index = ResidencyIndex()
    for m in messages:
        index.apply(m)
    return index


def _blocks(index: ResidencyIndex, chain: list = CHAIN, **kw) -> int:
    match = index.match("w", 0, chain, **kw)
    assert match is not None
    return match.blocks


def test_attention_only_is_the_contiguous_run_from_block_zero() -> None:
    index = _index(msg([stored(CHAIN[:4]), stored(CHAIN[5:7])]))
    assert _blocks(index) == 4
    index.apply(msg([removed([CHAIN[1]])]))
    assert _blocks(index) == 1


def test_state_needs_a_checkpoint_exactly_at_the_last_block() -> None:
    attention = msg([stored(CHAIN[:6])])
    # checkpoints after blocks 2 and 4 (positions 3 and 5)
    state = msg([stored([CHAIN[2]], group=STATE), stored([CHAIN[4]], group=STATE)], group=STATE)
    index = _index(attention, state)
    assert _blocks(index) == 5
    index.apply(msg([removed([CHAIN[4]], group=STATE)], group=STATE))
    assert _blocks(index) == 3
    match = index.match("w", 0, CHAIN)
    assert match is not None and match.limits == {ATTN: 6, STATE: 3}


def test_a_deep_checkpoint_beyond_attention_does_not_count() -> None:
    index = _index(msg([stored(CHAIN[:4])]),
                   msg([stored([CHAIN[6]], group=STATE), stored([CHAIN[1]], group=STATE)], group=STATE))
    assert _blocks(index) == 2  # p<=4 from attention; the only checkpoint at or before is at block 1


def test_no_checkpoint_at_all_means_nothing_is_reusable() -> None:
    index = _index(msg([stored(CHAIN[:6])]), msg([removed([CHAIN[0]], group=STATE)], group=STATE))
    assert _blocks(index) == 0


def test_state_removal_leaves_attention_alone_and_the_reverse() -> None:
    index = _index(msg([stored(CHAIN[:4])]), msg([stored([CHAIN[3]], group=STATE)], group=STATE))
    assert _blocks(index) == 4
    index.apply(msg([removed([CHAIN[3]], group=STATE)], group=STATE))
    view = index.view("w", 0)
    assert view is not None
    assert view.groups[ATTN].count("GPU", CHAIN[3]) == 1
    index.apply(msg([stored([CHAIN[3]], group=STATE)], group=STATE))
    index.apply(msg([removed([CHAIN[3]])]))
    assert view.groups[STATE].count("GPU", CHAIN[3]) == 1
    assert _blocks(index) == 0  # attention now stops at 3, and there is no checkpoint at block 2


def test_window_needs_only_its_last_blocks_before_the_position() -> None:
    assert window_blocks(33, 16) == 2  # vLLM: ceil((33 - 1) / 16)
    assert window_blocks(32, 16) == 2
    assert window_blocks(None, 16) is None
    attention = msg([stored(CHAIN[:8])])
    state = msg([stored([CHAIN[5]], group=STATE)], group=STATE)
    window = msg([stored(CHAIN[4:6], group=WIN)], group=WIN)  # blocks 4 and 5 only
    index = _index(attention, state, window)
    assert _blocks(index) == 6
    index.apply(msg([removed([CHAIN[4]], group=WIN)], group=WIN))
    assert _blocks(index) == 0  # p=6 needs blocks 4,5 in the window; no other checkpoint


def test_window_short_prefix_needs_every_block_from_zero() -> None:
    index = _index(msg([stored(CHAIN[:1], group=WIN)], group=WIN), msg([stored(CHAIN[:3])]))
    # p=1 < k=2: the window must hold block 0, which it does; p=2 and p=3 need block 1 too
    assert _blocks(index) == 1


def test_window_with_unknown_size_falls_back_to_every_block() -> None:
    index = _index(msg([stored(CHAIN[:6])]),
                   msg([stored(CHAIN[3:6], group=WIN, window=0)], group=WIN))
    view = index.view("w", 0)
    assert view is not None and view.groups[WIN].window is None
    assert _blocks(index) == 0


def test_window_placeholders_are_not_positions_and_their_removal_balances() -> None:
    index = _index(msg([stored(CHAIN[:2])]),
                   msg([stored([CHAIN[1]], group=WIN, medium="CPU", block_size=0)], group=WIN))
    view = index.view("w", 0)
    assert view is not None
    win = view.groups[WIN]
    assert win.resident("CPU") == 0 and win.placeholders["CPU"][CHAIN[1]] == 1
    assert _blocks(index) == 0
    index.apply(msg([removed([CHAIN[1]], group=WIN, medium="CPU")], group=WIN))
    assert win.unknown_removals == 0 and not win.placeholders["CPU"]


def test_other_family_groups_have_no_say() -> None:
    index = _index(msg([stored(CHAIN[:3])]), msg([removed([CHAIN[0]], group=OTHER_G)], group=OTHER_G))
    assert _blocks(index) == 3


def test_medium_filter_counts_only_the_named_tiers() -> None:
    index = _index(msg([stored(CHAIN[:2], medium="GPU"), stored(CHAIN[2:4], medium="CPU")]))
    assert _blocks(index) == 4
    assert _blocks(index, media={"GPU"}) == 2
    assert _blocks(index, media={"CPU"}) == 0
    assert _blocks(index, media={"CPU", "GPU"}) == 4


@pytest.mark.parametrize("stored_form", ["bytes", "int"])
def test_bytes_chain_matches_either_published_form(stored_form: str) -> None:
    hashes = CHAIN[:3] if stored_form == "bytes" else [hi(i) for i in range(3)]
    index = _index(msg([stored(hashes)]))
    assert _blocks(index, CHAIN) == 3
    int_chain = [hi(i) for i in range(8)]
    # ints cannot be turned back into bytes: an int chain matches only an int index
    assert _blocks(index, int_chain) == (3 if stored_form == "int" else 0)


def test_repeated_announcements_are_reference_counted() -> None:
    index = _index(msg([stored(CHAIN[:2]), stored(CHAIN[:1])]))
    index.apply(msg([removed([CHAIN[0]])]))
    assert _blocks(index) == 2  # one copy of block 0 is still there
    index.apply(msg([removed([CHAIN[0]]), removed([CHAIN[0]])]))
    view = index.view("w", 0)
    assert view is not None
    assert view.groups[ATTN].count("GPU", CHAIN[0]) == 0
    assert view.groups[ATTN].unknown_removals == 1
    assert _blocks(index) == 0
    index.apply(msg([stored([CHAIN[0]])]))
    assert _blocks(index) == 2  # never below zero: one store makes it resident again


def test_declared_state_group_blocks_until_it_checkpoints() -> None:
    index = ResidencyIndex()
    index.declare("w", 0, STATE, "mamba", 16)
    index.apply(msg([stored(CHAIN[:4])]))
    assert _blocks(index) == 0
    index.apply(msg([stored([CHAIN[1]], group=STATE)], group=STATE))
    assert _blocks(index) == 2


def test_longest_prefix_ranks_workers_and_skips_the_named_ones() -> None:
    index = _index(msg([stored(CHAIN[:2])], worker="a"), msg([stored(CHAIN[:5])], worker="b"),
                   msg([stored(CHAIN[:3])], worker="b", rank=1))
    ranked = [(m.worker, m.dp_rank, m.blocks) for m in index.longest_prefix(CHAIN)]
    assert ranked == [("b", 0, 5), ("b", 1, 3), ("a", 0, 2)]
    assert [m.worker for m in index.longest_prefix(CHAIN, skip_workers={"b"})] == ["a"]


def test_empty_chain_and_unknown_worker() -> None:
    index = _index(msg([stored(CHAIN[:2])]))
    assert _blocks(index, []) == 0
    assert index.match("nobody", 0, CHAIN) is None


class _Shape(NamedTuple):
    family: str
    block_size: int
    window: int | None


@given(family=st.sampled_from((ATTENTION, WINDOW_FAMILY, STATE_FAMILY)), block_size=st.integers(0, 4),
       window=st.none() | st.integers(-1, 20), held=st.lists(st.booleans(), max_size=12), data=st.data())
def test_allowed_at_is_the_group_limit_at_one_position_reading_only_what_it_needs(
        family: str, block_size: int, window: int | None, held: list[bool], data: st.DataObject) -> None:
    # The residency rules ask whether a worker could resume at one position
    # (report mode "full"); that answer must be the prefix rule's own.
    g = _Shape(family, block_size, window)
    k = data.draw(st.integers(0, len(held)))
    read: list[int] = []

    def held_at(i: int) -> bool:
        read.append(i)
        return held[i]

    assert allowed_at(g, held_at, k) == group_limit(g, held)[0][k]
    assert all(i < k for i in read)
    if family == STATE_FAMILY:
        assert read == ([k - 1] if k else [])
