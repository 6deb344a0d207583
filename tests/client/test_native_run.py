"""The native loop over a message's events (`RankTables.run_events`) gives
the views the index's own loop gives, over the benchmark's engine-shaped
hybrid traffic as the bridge publishes it: attention, window and state
groups, offloads, report-mode announcements of prefix hits and the
tokenless state stores taken back with them, decoded lean as the keeper
reads them. The reference machine (`tests/client/test_index_fleet.py`)
checks both loops against the reference index over arbitrary histories."""

from __future__ import annotations

import msgspec
import pytest

from bench.traffic import generate
from bridge.contract import GroupMessage
from bridge.contract.snapshot import encode_snapshot
from bridge.producer.decode.decoder import BatchDecoder
from bridge.producer.normalize.normalizer import KindBook, Normalizer, NormalizeStats, StreamIdentity
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.residency import ResidencyIndex
from bridge.residency.cells import NATIVE_CELL, PyCell
from bridge.residency.lean import residency_decoder
from bridge.residency.rank_tables import RankTables
from tests.client.builders import ATTN, STATE, WIN, hb, msg, removed, stored


def _published(size: int, rounds: int) -> list[bytes]:
    """The group payloads the bridge publishes for the traffic, `rounds` times over (the same hashes again)."""
    pool = generate((size,), pool_events=1500)[size]
    decoder, normalizer, encoder = BatchDecoder(relay=True), Normalizer(KindBook({}), False), MessageEncoder("msgpack")
    subjects, stats = SubjectBook("kv", "w", 0), NormalizeStats()
    ident = StreamIdentity(worker="w", dp_rank=0, topic="", epoch=1)
    out = []
    seq = 0
    for _ in range(rounds):
        for payload in pool.payloads:
            batch = decoder.decode(payload)
            for item in normalizer.normalize(ident, seq, batch.ts, batch.events, 0.0, stats):
                if isinstance(item, GroupMessage):
                    out.append(encoder.group(item, subjects, "w:0:1").payload)
            seq += 1
    return out


@pytest.mark.skipif(NATIVE_CELL is None, reason="built without the native module")
@pytest.mark.parametrize("size", [8, 64])
def test_the_native_loop_keeps_what_the_index_loop_keeps(size: int) -> None:
    native, python = ResidencyIndex(store=RankTables()), ResidencyIndex(store=RankTables(PyCell))
    stepped = ResidencyIndex(store=RankTables())  # in runs of 3 events, as the keeper's idle slices apply
    assert native.store.native_runs and not python.store.native_runs  # type: ignore[attr-defined]
    lean = residency_decoder()
    for payload in _published(size, rounds=2):
        native.apply_group(lean.decode(payload))
        python.apply_group(lean.decode(payload))
        for _ in stepped.apply_group_steps(lean.decode(payload), every=3):
            pass
    mine, theirs, steps = (index.snapshot("w", 0, now=0.0) for index in (native, python, stepped))
    assert mine is not None and theirs is not None and steps is not None
    assert encode_snapshot(mine) == encode_snapshot(theirs) == encode_snapshot(steps)
    assert native.reannounced_ignored == python.reannounced_ignored == stepped.reannounced_ignored > 0
    assert sum(g.stored for g in mine.groups) > 0 and sum(g.removed for g in mine.groups) > 0
    assert msgspec.structs.asdict(mine)["groups"] == msgspec.structs.asdict(theirs)["groups"]


@pytest.mark.skipif(NATIVE_CELL is None, reason="built without the native module")
def test_sizes_past_a_c_long_and_odd_media_go_the_same_way() -> None:
    """What the native loop does not read itself (a block size or window past
    a C long, an empty medium in a state group) goes to the index's loop,
    event by event, and ends as it would there."""
    huge = 2**64 - 1
    history = [
        msg([stored([hb(1), hb(2)], group=ATTN, block_size=huge)], group=ATTN),
        msg([stored([hb(1), hb(2)], group=WIN, window=huge)], group=WIN),
        msg([stored([hb(1), hb(2), hb(3)], group=STATE, medium="")], group=STATE),
        msg([stored([hb(3)], group=ATTN), removed([hb(1)], group=ATTN), stored([hb(4)], group=ATTN, block_size=16)],
            group=ATTN),
        msg([stored([hb(1), hb(2)], group=WIN, window=2**40), removed([hb(9)], group=WIN, medium="CPU")], group=WIN),
    ]
    native, python = ResidencyIndex(store=RankTables()), ResidencyIndex(store=RankTables(PyCell))
    for m in history:
        native.apply(m)
        python.apply(m)
    mine, theirs = native.snapshot("w", 0, now=0.0), python.snapshot("w", 0, now=0.0)
    assert mine is not None and theirs is not None
    assert encode_snapshot(mine) == encode_snapshot(theirs)
    state = next(g for g in mine.groups if g.group == STATE)
    assert state.tiers[0].trusted == [hb(3)]  # an empty medium is GPU's tier, and the state rule's "not GPU"
