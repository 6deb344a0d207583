"""The fleet's fast reading of a chain (ids in runs, columns sliced, answers
built per class) against its plain one (one lookup per block) and against
today's implementation, where the fast one could go wrong: ids freed with
a stale name, runs across chunks of names, known blocks after unknown ones,
holder sets changing inside a run, one layout or several."""

from __future__ import annotations

import gc
import random
from typing import Any

import pytest

from bridge.contract import BlockRemoved, BlockStored
from bridge.residency.fleet import FleetResidency
from bridge.residency.index import ResidencyIndex
from tests.client.builders import ATTN, STATE, WIN, hb, hi, msg, removed, stored
from tests.client.test_index_fleet import audit, fleet_traffic
from tests.reference_index import ReferenceIndex


def _both(items: list[Any]) -> tuple[ResidencyIndex, ReferenceIndex]:
    new, ref = ResidencyIndex(), ReferenceIndex()
    for item in items:
        new.apply(item)
        ref.apply(item)
    return new, ref


def _plain(fleet: FleetResidency, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet reads chains one lookup per block from now on."""
    monkeypatch.setattr(fleet._ids, "runs", lambda chain: None)


def _same(new: ResidencyIndex, ref: ReferenceIndex, chain: list[Any], monkeypatch: pytest.MonkeyPatch,
          **kw: Any) -> list[Any]:
    got = new.longest_prefix(chain, **kw)
    assert got == ref.longest_prefix(chain, **kw)
    hits = new.fleet.prefix_hits(chain, media=kw.get("media"), include_suspect=kw.get("include_suspect", False))
    with monkeypatch.context() as m:
        _plain(new.fleet, m)
        assert new.longest_prefix(chain, **kw) == got
        assert new.fleet.prefix_hits(chain, media=kw.get("media"),
                                     include_suspect=kw.get("include_suspect", False)) == hits
    return got


def test_a_run_stops_at_an_id_freed_whose_name_is_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    chain = [hi(i) for i in range(8)]
    other = [hi(100 + i) for i in range(4)]
    new, ref = _both([
        msg([stored(chain)], worker="a"),
        msg([stored(other)], worker="b"),
        msg([removed([chain[3]])], worker="a"),  # its id is freed ...
        msg([removed([other[2]])], worker="b"),  # ... then this one's, which the next new hash takes
        msg([stored(chain[:4])], worker="c"),  # chain[3] again: a new id, the old one still names it
    ])
    fleet = new.fleet
    ids = fleet._ids
    old = ids.by_hash[chain[2]] + 1
    assert ids.hash_at(old) == chain[3] and ids.by_hash[chain[3]] != old and not ids.state[old]
    got = _same(new, ref, chain, monkeypatch)
    assert [(m.worker, m.blocks) for m in got] == [("c", 4), ("a", 3), ("b", 0)]
    assert _same(new, ref, chain[3:], monkeypatch)[0].worker == "c"
    audit(fleet)


def test_runs_across_chunks_of_names_and_mismatches_inside_them(monkeypatch: pytest.MonkeyPatch) -> None:
    chain = [hi(i) for i in range(700)]
    elsewhere = [hi(5000 + i) for i in range(300)]
    new, ref = _both([
        msg([stored(elsewhere)], worker="x"),
        msg([stored(chain[:600])], worker="a"),
        msg([stored(chain[:300]), stored(chain[:100], medium="CPU")], worker="b"),
        msg([stored(chain[7::8], group=STATE)], group=STATE, worker="a"),
        msg([stored(chain[500:600], group=WIN)], group=WIN, worker="a"),
    ])
    queries = [
        chain,
        chain[:300] + [hi(9999)] + chain[301:],  # an unknown block inside a run
        chain[:260] + elsewhere[10:20] + chain[270:],  # known blocks of another run inside one
        [hi(9999)] + chain[1:],  # unknown first, then one long known stretch
        [hi(9998 - j) for j in range(50)] + chain[100:110] + [hi(9000 + j) for j in range(50)],
        chain[::-1],
        chain[255:258] + chain[511:514],
    ]
    for q in queries:
        for kw in ({}, {"media": ("GPU",)}, {"media": ("CPU",)}, {"include_suspect": True}):
            _same(new, ref, q, monkeypatch, **kw)
    assert _same(new, ref, chain, monkeypatch)[0].blocks == 600  # a: attention to 600, a checkpoint at 599


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_seeded_fleets_read_fast_as_plain(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    items, chains = fleet_traffic(seed, 25, window=33, block=16, int_form=seed != 12)
    new, ref = _both(items)
    rnd = random.Random(seed)
    form = hb if seed == 12 else hi
    for _ in range(30):
        numbers = list(rnd.choice(chains))
        if rnd.random() < 0.5:
            numbers += [7_000_000 + j for j in range(rnd.randint(1, 80))]
        if rnd.random() < 0.3:
            numbers += rnd.choice(chains)  # known blocks after unknown ones
        if rnd.random() < 0.3:
            rnd.shuffle(numbers)
        kw: dict[str, Any] = rnd.choice([{}, {"media": ("GPU",)}, {"include_suspect": True}, {"include_unwatched": True},
                                         {"skip_workers": {"w1", "w3"}}])
        _same(new, ref, [form(i) for i in numbers], monkeypatch, **kw)
    # removals free ids; new hashes take them
    for item in items[: len(items) // 2]:
        events = getattr(item, "events", None)
        if events and type(events[0]) is BlockStored:
            ev = events[0]
            m = msg([BlockRemoved(block_hashes=ev.block_hashes, medium=ev.medium, group_idx=ev.group_idx)],
                    group=item.group, worker=item.worker, kind=item.kind)
            new.apply(m)
            ref.apply(m)
    fresh = [form(8_000_000 + j) for j in range(200)]
    m = msg([stored(fresh)], worker="w0")
    new.apply(m)
    ref.apply(m)
    audit(new.fleet)
    for numbers in chains[:10]:
        _same(new, ref, [form(i) for i in numbers] + fresh[:50], monkeypatch)


def test_one_layout_many_workers_answers_by_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker with the same groups (one template of limits): the answers
    come from classes of equal limits; several depths, several classes."""
    chain = [hi(i) for i in range(40)]
    items = []
    for w in range(12):
        name = f"w{w:02d}"
        depth = 4 * (w % 6) + 4
        items.append(msg([stored(chain[:depth])], worker=name))
        items.append(msg([stored(chain[:depth], group=WIN)], group=WIN, worker=name))
        items.append(msg([stored(chain[depth - 1 - 4 * (w % 2):depth:4], group=STATE)], group=STATE, worker=name))
    new, ref = _both(items)
    got = _same(new, ref, chain, monkeypatch)
    assert len({tuple(sorted(m.limits.items())) for m in got}) > 3
    assert len({m.blocks for m in got}) > 3
    # every answer owns its limits
    got[0].limits[ATTN] = -1
    assert all(m.limits[ATTN] != -1 for m in got[1:])
    assert new.longest_prefix(chain) == ref.longest_prefix(chain)


def test_answers_are_not_tracked_by_the_cyclic_collector() -> None:
    new, _ = _both([msg([stored([hi(0)])], worker="a"), msg([stored([hi(0)])], worker="b")])
    assert not any(gc.is_tracked(m) for m in new.longest_prefix([hi(0), hi(1)]))


def test_a_bytes_block_after_known_ints_is_found_in_int_form(monkeypatch: pytest.MonkeyPatch) -> None:
    ints = [hi(i) for i in range(6)]
    new, ref = _both([msg([stored(ints)], worker="a"), msg([stored(ints[:2])], worker="b")])
    for chain in (ints[:4] + [hb(4)] + ints[5:], ints[:4] + [hb(4), hb(5)], [hb(0)] + ints[1:]):
        got = _same(new, ref, chain, monkeypatch)
        assert (got[0].worker, got[0].blocks) == ("a", 6)


def test_a_run_of_ints_stops_at_an_id_reused_by_a_bytes_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    ints = [hi(i) for i in range(4)]
    new, ref = _both([
        msg([stored(ints)], worker="a"),
        msg([removed([ints[2]])], worker="a"),
        msg([stored([hb(9)])], worker="a"),  # takes the id ints[2] had
    ])
    fleet = new.fleet
    assert fleet._ids.by_hash[hb(9)] == fleet._ids.by_hash[ints[1]] + 1
    got = _same(new, ref, ints, monkeypatch)
    assert (got[0].worker, got[0].blocks) == ("a", 2)
