"""The fleet structure's own face: aggregate counts, many workers at once, ids freed."""

from __future__ import annotations

from bridge.client.subscribe import Interruption
from bridge.residency.fleet import HashCount, ResidentCount
from bridge.residency.index import ResidencyIndex
from bridge.residency.prefix import PrefixMatch
from tests.client.builders import ATTN, STATE, hb, hi, msg, record, removed, stored

CHAIN = [hb(i) for i in range(8)]


def _fed(*items) -> ResidencyIndex:
    index = ResidencyIndex()
    for item in items:
        index.apply(item)
    return index


def test_resident_counts_per_worker_group_family_and_medium() -> None:
    index = _fed(msg([stored(CHAIN[:4]), stored(CHAIN[:2], medium="CPU")], worker="a"),
                 msg([stored([CHAIN[3]], group=STATE)], group=STATE, worker="a"),
                 msg([stored(CHAIN[:3])], worker="b"), record("gap", worker="b", gap=(1, 2)),
                 msg([stored(CHAIN[:1])], worker="b"))
    rows = {(r.worker, r.group, r.medium): r for r in index.fleet.resident_counts()}
    assert rows[("a", ATTN, "GPU")] == ResidentCount("a", 0, ATTN, "attention", "GPU", 4, 0, 0)
    assert rows[("a", ATTN, "CPU")].trusted == 2
    assert rows[("a", STATE, "GPU")].family == "state"
    assert rows[("b", ATTN, "GPU")] == ResidentCount("b", 0, ATTN, "attention", "GPU", 1, 3, 0)


def test_hash_counts_tell_shared_hashes_apart() -> None:
    index = _fed(msg([stored(CHAIN[:4])], worker="a"), msg([stored(CHAIN[2:6])], worker="b"),
                 msg([stored(CHAIN[5:7], medium="CPU")], worker="c"))
    counts = {(c.group, c.medium): c for c in index.fleet.hash_counts()}
    assert counts[(ATTN, "GPU")] == HashCount(ATTN, "GPU", 6, 2, 8)  # blocks 2 and 3 held twice
    assert counts[(ATTN, "CPU")] == HashCount(ATTN, "CPU", 2, 0, 2)
    assert counts[(ATTN, None)] == HashCount(ATTN, None, 7, 3, 0)  # any medium: block 5 by b and c too
    index.apply(msg([removed([CHAIN[2]])], worker="b"))
    counts = {(c.group, c.medium): c for c in index.fleet.hash_counts()}
    assert counts[(ATTN, "GPU")].shared == 1 and counts[(ATTN, None)].shared == 2
    assert index.fleet.hashes == 7 and index.fleet.entries == 9


def test_prefix_hits_names_only_the_workers_that_can_reuse_something() -> None:
    index = _fed(*(msg([stored(CHAIN[:n])], worker=f"w{n}") for n in range(8)), record("stop", worker="w7"))
    hits = index.fleet.prefix_hits(CHAIN)
    assert [(k.worker, p) for k, p in hits] == [(f"w{n}", n) for n in range(6, 0, -1)]
    assert [k.worker for k, _ in index.fleet.prefix_hits(CHAIN, min_blocks=5)] == ["w6", "w5"]
    assert [k.worker for k, _ in index.fleet.prefix_hits(CHAIN, include_unwatched=True, skip_workers={"w6"})][:2] == [
        "w7", "w5"]


def test_ids_are_freed_with_the_last_copy_and_reused() -> None:
    index = _fed(msg([stored(CHAIN), stored([hi(i) for i in range(8)], medium="CPU")], worker="a"),
                 msg([stored(CHAIN[:4], group=STATE)], group=STATE, worker="b"))
    assert index.fleet.hashes == 16
    index.apply(msg([removed(CHAIN[4:])], worker="a"))
    assert index.fleet.hashes == 12
    index.apply(record("cleared", worker="a"))
    assert index.fleet.hashes == 4  # b's state checkpoints hold blocks 0..3
    index.apply(record("restart", worker="b", epoch=2))
    assert index.fleet.hashes == 0 and index.fleet.entries == 0
    index.apply(msg([stored(CHAIN[:3])], worker="c"))
    assert index.fleet.hashes == 3 and index.match("c", 0, CHAIN).blocks == 3  # type: ignore[union-attr]
    index.forget("c")
    assert index.fleet.hashes == 0 and set(index.views) == {("a", 0), ("b", 0)}


def test_an_interruption_makes_the_whole_fleet_suspect_and_new_stores_trusted() -> None:
    index = _fed(*(msg([stored(CHAIN[:5]), stored(CHAIN[:5], medium="CPU")], worker=w) for w in "abc"))
    index.apply(Interruption("disconnect", 0.0))
    assert all(m.blocks == 0 and m.stale for m in index.longest_prefix(CHAIN))
    assert [m.blocks for m in index.longest_prefix(CHAIN, include_suspect=True)] == [5, 5, 5]
    index.apply(msg([stored(CHAIN[:2], medium="CPU")], worker="b"))
    assert [(m.worker, m.blocks) for m in index.longest_prefix(CHAIN)] == [("b", 2), ("a", 0), ("c", 0)]
    assert index.longest_prefix(CHAIN, media={"GPU"})[0].blocks == 0
    for w in "abc":
        index.apply(msg([removed(CHAIN[:5]), removed(CHAIN[:5], medium="CPU")], worker=w))
    # a removal takes the trusted copy first: b's suspect CPU copies of blocks 0 and 1 stay
    assert [(m.worker, m.stale) for m in index.longest_prefix(CHAIN)] == [("a", False), ("b", True), ("c", False)]
    assert index.fleet.hashes == 2
    assert index.longest_prefix(CHAIN, include_suspect=True)[0] == PrefixMatch("b", 0, 2, True, {ATTN: 2})
    index.apply(msg([removed(CHAIN[:2], medium="CPU")], worker="b"))
    assert not any(m.stale for m in index.longest_prefix(CHAIN)) and index.fleet.hashes == 0
