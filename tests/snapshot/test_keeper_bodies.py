"""The keeper applies the structs the bridge encoded, not their payloads
decoded again, and keeps the same residency either way.

While its log and the relay's queue are short, each message the sink hands
over carries the struct its payload encodes (`Outgoing.body`); the keeper
applies that as it is. Over the benchmark's engine-shaped hybrid traffic
(attention, window and state groups, offloads, report-mode announcements of
prefix hits), a keeper fed structs and one fed payloads serve the same
snapshots byte for byte."""

from __future__ import annotations

import msgspec
import pytest

from bench.traffic import generate
from bridge.contract import GroupMessage
from bridge.contract.snapshot import encode_snapshot
from bridge.producer.decode.decoder import BatchDecoder
from bridge.producer.decode.wire import RelayBlockStored
from bridge.producer.normalize.normalizer import KindBook, Normalizer, NormalizeStats, StreamIdentity
from bridge.producer.sink.encode import MessageEncoder, Outgoing
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import (
    BODIES_WHILE_LOG_UNDER,
    BODY_BYTES_PER_PAYLOAD_BYTE,
    ENTRY_BYTES,
    ResidencyKeeper,
)
from bridge.residency import ResidencyIndex
from bridge.residency.cells import NATIVE_CELL, Cell, CellLike, PyCell
from bridge.residency.rank_tables import RankTables

WORKER = "w"


def _sent(size: int, keep_body: bool, rounds: int = 2) -> list[list[Outgoing]]:
    """The messages the bridge sends for the traffic, batch by batch, `rounds` times over."""
    pool = generate((size,), pool_events=1500)[size]
    decoder, normalizer, encoder = BatchDecoder(relay=True), Normalizer(KindBook({}), False), MessageEncoder("msgpack")
    subjects, stats = SubjectBook("kv", WORKER, 0), NormalizeStats()
    ident = StreamIdentity(worker=WORKER, dp_rank=0, topic="", epoch=1)
    batches, seq = [], 0
    for _ in range(rounds):
        for payload in pool.payloads:
            batch = decoder.decode(payload)
            batches.append([encoder.group(item, subjects, f"{WORKER}:0:1", keep_body)
                            for item in normalizer.normalize(ident, seq, batch.ts, batch.events, 0.0, stats)
                            if isinstance(item, GroupMessage)])
            seq += 1
    return batches


def _kept(batches: list[list[Outgoing]], cell: type[CellLike] = Cell, stepped: bool = False) -> ResidencyKeeper:
    keeper = ResidencyKeeper(WORKER, cell=cell)
    for out in batches:
        keeper.published(out)
        while keeper.pending:
            keeper.catch_up(seconds=1e-9 if stepped else 0.0)
    return keeper


def _snapshot(keeper: ResidencyKeeper) -> bytes:
    snap = keeper.snapshot(0)
    assert snap is not None
    # the clock's readings aside: when each was taken and applied
    return encode_snapshot(msgspec.structs.replace(snap, taken_at=0.0, last_ts=0.0))


@pytest.mark.parametrize("size", [8, 64])
@pytest.mark.parametrize("cell", [Cell, PyCell], ids=["native-or-fallback", "python"])
def test_structs_and_payloads_give_the_same_snapshot(size: int, cell: type[CellLike]) -> None:
    bodies, payloads = _sent(size, keep_body=True), _sent(size, keep_body=False)
    assert all(m.body is not None for out in bodies for m in out)
    assert all(m.body is None for out in payloads for m in out)
    by_struct, by_payload = _kept(bodies, cell), _kept(payloads, cell)
    assert _snapshot(by_struct) == _snapshot(by_payload)
    assert by_struct.applied == by_payload.applied
    assert by_struct.index.reannounced_ignored == by_payload.index.reannounced_ignored > 0
    # in the idle slices' pieces too
    assert _snapshot(_kept(_sent(size, keep_body=True), cell, stepped=True)) == _snapshot(by_payload)


def test_a_struct_is_applied_without_reading_its_payload() -> None:
    """The payload of a message that carries its struct is never decoded:
    bytes no decoder reads change nothing, and nothing is undecodable."""
    bodies = _sent(8, keep_body=True, rounds=1)
    garbled = [[msgspec.structs.replace(m, payload=b"\xc1" * len(m.payload)) for m in out] for out in bodies]
    reference = _kept(_sent(8, keep_body=False, rounds=1))
    keeper = _kept(garbled)
    assert keeper.undecodable == 0
    assert _snapshot(keeper) == _snapshot(reference)


def test_structs_count_against_the_log_as_the_memory_they_hold() -> None:
    keeper = ResidencyKeeper(WORKER)
    out = _sent(64, keep_body=True, rounds=1)[0]
    keeper.published(out)
    assert keeper.log_bytes == sum(BODY_BYTES_PER_PAYLOAD_BYTE * len(m.payload) + ENTRY_BYTES for m in out)
    assert keeper.takes_bodies()
    keeper.log_bytes = BODIES_WHILE_LOG_UNDER  # a log that grew in a burst takes payloads alone
    assert not keeper.takes_bodies()


@pytest.mark.skipif(NATIVE_CELL is None, reason="built without the native module")
def test_the_native_loop_reads_the_relays_stores_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores of a class the tables were told of go through the native loop;
    any other class is left to the index's own loop, event by event."""
    bodies = [m.body for out in _sent(64, keep_body=True, rounds=1) for m in out]
    assert any(type(ev) is RelayBlockStored for body in bodies for ev in body.events)  # type: ignore[union-attr]
    left: list[int] = []
    python_loop = ResidencyIndex._apply_events_py

    def counted(self: ResidencyIndex, *args: object, **kwargs: object) -> object:
        left.append(1)
        return python_loop(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ResidencyIndex, "_apply_events_py", counted)
    told, untold = ResidencyIndex(store=RankTables(stores=(RelayBlockStored,))), ResidencyIndex(store=RankTables())
    for body in bodies:
        told.apply_group(body)  # type: ignore[arg-type]
    assert not left
    for body in bodies:
        untold.apply_group(body)  # type: ignore[arg-type]
    assert left
    mine, theirs = told.snapshot(WORKER, 0, now=0.0), untold.snapshot(WORKER, 0, now=0.0)
    assert mine is not None and theirs is not None
    assert encode_snapshot(msgspec.structs.replace(mine, last_ts=0.0)) == \
        encode_snapshot(msgspec.structs.replace(theirs, last_ts=0.0))


def test_the_tables_read_only_stores_natively() -> None:
    with pytest.raises(TypeError):
        RankTables(stores=(int,))  # type: ignore[arg-type]
