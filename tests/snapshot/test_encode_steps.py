"""A snapshot encoded a piece at a time (`encode_snapshot_steps`, what the
bridge's keeper does on its event loop) is byte for byte the snapshot encoded
at once, whatever its lists hold and however long they are."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from bridge.contract.snapshot import (
    GroupState,
    RankSnapshot,
    TierState,
    decode_snapshot,
    encode_snapshot,
    encode_snapshot_steps,
)

hashes = st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=32, max_size=32)), max_size=40)
counts = st.lists(st.integers(0, 2**40), max_size=40)
tiers = st.builds(TierState, medium=st.sampled_from(["GPU", "CPU", "DISK"]), trusted=hashes, trusted_copies=counts,
                  suspect=hashes, suspect_copies=counts, placeholders=hashes, placeholder_copies=counts)
groups = st.builds(GroupState, group=st.integers(0, 8), kind=st.just("full_attention"), family=st.just("attention"),
                   tiers=st.lists(tiers, max_size=3))
snapshots = st.builds(RankSnapshot, v=st.just(1), worker=st.text(max_size=8), dp_rank=st.integers(0, 4),
                      epoch=st.integers(0, 2**40), taken_at=st.floats(0, 2e9), groups=st.lists(groups, max_size=3))


def _run(steps: Generator[None, None, Any]) -> tuple[Any, int]:
    n = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, n
        n += 1


@given(snapshots, st.integers(1, 20))
def test_encoded_in_pieces_is_encoded_at_once(snap: RankSnapshot, step: int) -> None:
    data, _ = _run(encode_snapshot_steps(snap, step))
    assert data == encode_snapshot(snap)


def test_long_lists_cross_every_array_header_and_pause_between_pieces() -> None:
    # 15/16 and 65535/65536 items: where msgpack's array header grows
    tier = TierState("GPU", trusted=list(range(70_000)), trusted_copies=[2] * 65_536, suspect=[b"\x01" * 32] * 65_535,
                     placeholders=list(range(16)), placeholder_copies=[1] * 15)
    snap = RankSnapshot(v=1, worker="w", dp_rank=0, epoch=1, taken_at=1.0,
                        groups=[GroupState(0, "full_attention", "attention", tiers=[tier])])
    data, pauses = _run(encode_snapshot_steps(snap, 4096))
    assert data == encode_snapshot(snap)
    assert decode_snapshot(data) == snap
    assert pauses >= (70_000 + 65_536 + 65_535) // 4096, "a pause at least every 4,096 items of a long list"
