"""The normalizer on events as real publishers send them: kinds of a vLLM
0.20/0.21 publisher, state stores by tier, and the bounds that keep one
hostile batch (or a stream of them) from costing unbounded messages or memory."""

from __future__ import annotations

import time
from typing import Any, cast

import msgspec
import pytest

from bridge.contract import MAX_GROUP_ID, BlockStored, GroupMessage, WorkerRecord, decoder_for, parse_group_kind
from bridge.producer.decode.decoder import BatchDecoder
from bridge.producer.normalize import normalizer as normalizer_module
from bridge.producer.normalize.normalizer import (
    BAD_GROUP,
    MAX_EVENTS_PER_BATCH,
    MAX_MESSAGES_PER_BATCH,
    TOO_MANY_EVENTS,
    TOO_MANY_MESSAGES,
    KindBook,
    Normalizer,
    NormalizeStats,
    StreamIdentity,
)
from bridge.producer.sink.catalog import GroupCatalog
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.queue import OutBatch
from bridge.producer.sink.subjects import SubjectBook

enc = msgspec.msgpack.encode
IDENT = StreamIdentity(worker="w", dp_rank=0, topic="", epoch=1)
H = [bytes([i]) * 32 for i in range(8)]


class Run:
    """One publisher's stream through a decoder and a normalizer."""

    def __init__(self, relay: bool = True, pinned: dict[int, str] | None = None) -> None:
        self.decoder = BatchDecoder(relay=relay)
        self.normalizer = Normalizer(KindBook(pinned or {}), keep_placeholders=False)
        self.stats = NormalizeStats()
        self.seq = 0

    def batch(self, events: list[Any]) -> list[GroupMessage | WorkerRecord]:
        decoded = self.decoder.decode(enc([time.time(), events, 0]))
        assert decoded.rejected == []
        self.seq += 1
        return self.normalizer.normalize(IDENT, self.seq, decoded.ts, decoded.events, time.time(), self.stats)


def groups(items: list[GroupMessage | WorkerRecord]) -> dict[int, GroupMessage]:
    return {i.group: i for i in items if isinstance(i, GroupMessage)}


def stored_map(hashes: list[Any], group: int, kind: str | None, medium: str | None = "GPU", **more: Any) -> dict:
    """A store as vLLM 0.24+ sends it (tagged map, required fields present)."""
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": list(range(64)),
          "block_size": 16, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": group, **more}
    if kind is not None:
        ev["kv_cache_spec_kind"] = kind
    return ev


# -- vLLM 0.20/0.21: group ids, no kinds --------------------------------------


def stored_020(hashes: list[bytes], group: int) -> list[Any]:
    """A store as vLLM 0.20.0-0.21.0 encode it: an array up to group_idx."""
    return ["BlockStored", hashes, None, [1, 2, 3], 16, None, "GPU", None, None, group]


def removed_020(hashes: list[bytes], group: int) -> list[Any]:
    return ["BlockRemoved", hashes, "GPU", group]


@pytest.mark.parametrize("relay", [True, False])
def test_a_0_20_publisher_has_group_0_as_legacy_full_attention(relay: bool) -> None:
    run = Run(relay)
    first = groups(run.batch([stored_020([H[0]], 0), stored_020([H[1]], 1)]))
    assert (first[0].kind, first[0].family, first[0].kind_source) == ("full_attention", "attention", "legacy")
    # another group stays unknown until a kind is pinned or learned
    assert (first[1].kind, first[1].family, first[1].kind_source) == ("unknown", "other", "unknown")
    # removals keep the same reading
    later = groups(run.batch([removed_020([H[0]], 0), removed_020([H[1]], 1)]))
    assert (later[0].kind, later[0].kind_source) == ("full_attention", "legacy")
    assert later[1].kind == "unknown"


def test_a_pinned_kind_wins_over_the_legacy_reading() -> None:
    run = Run(pinned={0: "sliding_window", 1: "mamba"})
    got = groups(run.batch([stored_020([H[0]], 0), stored_020([H[1]], 1)]))
    assert [(g.kind, g.kind_source) for g in got.values()] == [("sliding_window", "pinned"), ("mamba", "pinned")]


def test_group_0_is_not_legacy_once_the_publisher_names_kinds() -> None:
    run = Run()
    # a kind-naming publisher whose first group-0 events are removals: never seen, unknown
    first = groups(run.batch([{"type": "BlockRemoved", "block_hashes": [H[0]], "medium": "GPU", "group_idx": 0},
                              stored_map([H[1]], 1, "mamba")]))
    assert (first[0].kind, first[0].kind_source) == ("unknown", "unknown")
    # a kindless store of group 0 from a publisher that names kinds is not a 0.20 publisher's
    second = groups(run.batch([stored_map([H[2]], 0, None)]))
    assert second[0].kind == "unknown"
    third = groups(run.batch([stored_map([H[3]], 0, "sliding_window")]))
    assert (third[0].kind, third[0].kind_source) == ("sliding_window", "event")


def test_a_restarted_publisher_is_read_afresh() -> None:
    run = Run()
    run.batch([stored_map([H[0]], 0, "sliding_window")])
    run.normalizer.kinds.forget()  # what the pipeline does on a new epoch
    got = groups(run.batch([stored_020([H[1]], 0)]))
    assert (got[0].kind, got[0].kind_source) == ("full_attention", "legacy")


def test_remembered_decisions_follow_the_kind_book(monkeypatch: pytest.MonkeyPatch) -> None:
    """The normalizer keeps what each slice resolved to across batches: a
    restart (the book forgets) makes it learn and decide again, and a
    publisher inventing kinds fills at most MAX_DECISIONS of them."""
    monkeypatch.setattr(normalizer_module, "MAX_DECISIONS", 8)
    run = Run()
    for _ in range(2):
        got = groups(run.batch([stored_map([H[0]], 1, "sliding_window")]))
        assert (got[1].kind, got[1].family, got[1].kind_source) == ("sliding_window", "window", "event")
    run.normalizer.kinds.forget()
    # the same kind again: learned again, though it was decided before the restart
    got = groups(run.batch([stored_map([H[0]], 1, "sliding_window")]))
    assert (got[1].kind, got[1].kind_source) == ("sliding_window", "event")
    assert run.normalizer.kinds.known() == {1: "sliding_window"}
    run.normalizer.kinds.forget()
    got = groups(run.batch([stored_map([H[1]], 1, "mamba")]))
    assert (got[1].kind, got[1].family, got[1].kind_source) == ("mamba", "state", "event")
    for n in range(40):
        got = groups(run.batch([stored_map([H[2]], 1, f"kind_{n}")]))
        assert (got[1].kind, got[1].kind_source) == ("mamba", "learned")
    assert len(run.normalizer._decided) <= 8


def test_events_with_neither_group_nor_kind_are_legacy() -> None:
    run = Run()
    got = run.batch([["BlockStored", [H[0]], None, [1], 16, None, "GPU"], ["BlockRemoved", [H[0]], "GPU"]])
    assert [(g.group, g.kind, g.kind_source, len(g.events)) for g in groups(got).values()] == [
        (0, "full_attention", "legacy", 2)]


# -- state groups --------------------------------------------------------------


def _state_events(msg: GroupMessage) -> list[Any]:
    """The slice as a consumer decodes it off the bus."""
    back = decoder_for("msgpack", GroupMessage).decode(MessageEncoder("msgpack").group(msg, SubjectBook("kv", "w", 0),
                                                                                         "w:0:1").payload)
    return back.events


@pytest.mark.parametrize("relay", [True, False])
@pytest.mark.parametrize("medium", ["GPU", None])
def test_in_the_gpu_tier_every_state_hash_is_a_checkpoint(relay: bool, medium: str | None) -> None:
    run = Run(relay)
    items = run.batch([stored_map(H[:3], 2, "mamba", medium=medium, parent_block_hash=H[7],
                                  lookahead_token_ids=[[1, 2], [3]])])
    (event,) = _state_events(groups(items)[2])
    assert event.block_hashes == H[:3] and event.parent_block_hash == H[7]
    assert event.token_ids == [] and event.lookahead_token_ids is None
    assert "state_reduced" not in run.stats.transformed


@pytest.mark.parametrize("relay", [True, False])
@pytest.mark.parametrize("medium", ["CPU", "STORAGE"])
def test_in_an_offload_tier_a_state_store_is_reduced_to_its_last_hash(relay: bool, medium: str) -> None:
    run = Run(relay)
    items = run.batch([stored_map(H[:3], 2, "mamba", medium=medium, parent_block_hash=H[7]),
                       stored_map([H[4]], 2, "mamba", medium=medium)])
    reduced, single = _state_events(groups(items)[2])
    assert (reduced.block_hashes, reduced.parent_block_hash, reduced.token_ids) == ([H[2]], H[1], [])
    assert (single.block_hashes, single.parent_block_hash, single.token_ids) == ([H[4]], None, [])
    assert run.stats.transformed["state_reduced"] == 1


def test_a_state_store_with_no_hash_is_dropped_and_counted() -> None:
    run = Run()
    run.batch([stored_map([H[2]], 2, "mamba")])  # the group has had its first message
    # what a real engine's Mamba group sends for blocks that hold no state
    items = run.batch([stored_map([], 2, "mamba"), stored_map([], 2, "mamba"), stored_map([H[0]], 0, "full_attention")])
    assert list(groups(items)) == [0]
    assert run.stats.dropped["state_no_hash"] == 2
    items = run.batch([stored_map([], 2, "mamba"), stored_map([H[1]], 2, "mamba")])
    assert [e.block_hashes for e in groups(items)[2].events] == [[H[1]]]


@pytest.mark.parametrize("relay", [True, False])
def test_a_groups_first_slice_goes_out_as_its_shape_when_nothing_in_it_names_a_position(relay: bool) -> None:
    """A real engine's first request: the attention group stores blocks, the
    state groups only hash-less stores. Consumers must learn of the state
    groups from this batch on (an empty state group allows no prefix)."""
    run = Run(relay)
    attention = stored_map(H[:2], 3, "full_attention", block_size=640)
    hashless = stored_map([], 0, "mamba", block_size=640, parent_block_hash=H[7], extra_keys=[["salt"]],
                          lookahead_token_ids=[[1]])
    items = run.batch([attention, hashless, stored_map([], 0, "mamba", block_size=640)])
    got = groups(items)
    assert list(got) == [3, 0]
    (shape,) = _state_events(got[0])
    assert (got[0].kind, got[0].family) == ("mamba", "state")
    assert (shape.block_hashes, shape.parent_block_hash, shape.token_ids) == ([], None, [])
    assert (shape.block_size, shape.medium, shape.group_idx, shape.kv_cache_spec_kind) == (640, "GPU", 0, "mamba")
    assert shape.extra_keys is None and shape.lookahead_token_ids is None
    assert run.stats.dropped["state_no_hash"] == 1 and run.stats.transformed["group_shape"] == 1
    # met once: its hash-less stores go as before
    assert 0 not in groups(run.batch([stored_map([], 0, "mamba"), stored_map(H[2:3], 3, "full_attention")]))
    # a new publisher process: every group is met anew
    run.normalizer.restarted()
    assert list(groups(run.batch([stored_map([], 0, "mamba")]))) == [0]


def test_a_window_group_of_placeholders_only_goes_out_once_as_its_shape() -> None:
    run = Run()
    placeholder = stored_map([H[1]], 1, "sliding_window", medium="CPU", block_size=0,
                             kv_cache_spec_sliding_window=80)
    (shape,) = groups(run.batch([placeholder]))[1].events
    assert isinstance(shape, BlockStored)
    assert (shape.block_hashes, shape.medium, shape.kv_cache_spec_sliding_window) == ([], "CPU", 80)
    assert run.stats.dropped["window_placeholder"] == 0
    assert groups(run.batch([placeholder])) == {}
    assert run.stats.dropped["window_placeholder"] == 1


# -- bounds on hostile batches -------------------------------------------------

CLEAR = {"type": "AllBlocksCleared"}


def test_consecutive_clears_are_one_record() -> None:
    run = Run()
    items = run.batch([CLEAR] * 10_000)
    assert [type(i) for i in items] == [WorkerRecord]
    assert run.stats.dropped["repeated_clear"] == 9_999


def test_clears_with_events_between_them_all_count() -> None:
    run = Run()
    items = run.batch([CLEAR, stored_map([H[0]], 0, "full_attention"), CLEAR, CLEAR,
                       {"type": "BlockRemoved", "block_hashes": [H[0]], "medium": "GPU", "group_idx": 0}, CLEAR])
    shape = [i.type if isinstance(i, WorkerRecord) else f"part{i.part}" for i in items]
    assert shape == ["cleared", "part1", "cleared", "part2", "cleared"]
    assert run.stats.dropped["repeated_clear"] == 1


@pytest.mark.parametrize("group", [-1, MAX_GROUP_ID + 1, 2**40])
def test_a_group_id_no_engine_has_is_malformed(group: int) -> None:
    run = Run()
    items = run.batch([stored_map([H[0]], group, "mamba"), stored_map([H[1]], MAX_GROUP_ID, "mamba")])
    assert list(groups(items)) == [MAX_GROUP_ID]
    assert run.stats.malformed == {BAD_GROUP: 1}
    assert str(group) in run.stats.malformed_detail


def test_a_batch_yields_a_bounded_number_of_messages() -> None:
    run = Run()
    items = run.batch([stored_map([H[0]], g, "full_attention") for g in range(300)])
    assert len(items) == MAX_MESSAGES_PER_BATCH
    assert run.stats.malformed == {TOO_MANY_MESSAGES: 300 - MAX_MESSAGES_PER_BATCH}
    # the batch is cut at the bound, in order: what went before it is whole
    assert [cast(GroupMessage, i).group for i in items] == list(range(MAX_MESSAGES_PER_BATCH))


def test_clears_between_events_count_toward_the_bound() -> None:
    run = Run()
    events = [e for _ in range(1000) for e in (stored_map([H[0]], 0, "full_attention"), CLEAR)]
    items = run.batch(events)
    assert len(items) == MAX_MESSAGES_PER_BATCH
    assert run.stats.malformed[TOO_MANY_MESSAGES] == len(events) - MAX_MESSAGES_PER_BATCH


def test_a_batch_holds_a_bounded_number_of_stores_and_removals() -> None:
    run = Run()
    removal = ["BlockRemoved", [H[0]], "GPU", 0]
    items = run.batch([removal] * (MAX_EVENTS_PER_BATCH + 10))
    assert sum(len(i.events) for i in items if isinstance(i, GroupMessage)) == MAX_EVENTS_PER_BATCH
    assert run.stats.malformed == {TOO_MANY_EVENTS: 10}
    # clears say nothing new when repeated: they take no room
    items = run.batch([CLEAR] * (MAX_EVENTS_PER_BATCH + 10) + [removal])
    assert [type(i) for i in items] == [WorkerRecord, GroupMessage]
    assert run.stats.malformed == {TOO_MANY_EVENTS: 10}


def test_publisher_chosen_kinds_and_groups_grow_no_table() -> None:
    """Every batch names a new kind string and a new group: the normalizer's
    kind table, the kind book, the subject book and the registry's catalog
    stay within their bounds."""
    run = Run()
    subjects = SubjectBook("kv", "w", 0)
    encoder = MessageEncoder("msgpack")
    catalog = GroupCatalog()
    for n in range(3000):
        kind = f"kind_{n}" if n % 2 else f"Kind {n} " + "x" * 1000
        items = run.batch([stored_map([H[0]], n % (MAX_GROUP_ID + 1), kind), stored_map([H[1]], n, kind)])
        messages = [encoder.group(i, subjects, "w:0:1") for i in items if isinstance(i, GroupMessage)]
        catalog.observe(OutBatch(0, 1, n, 0.0, messages))
        subjects.group(-n)  # a caller passing ids the pipeline never would
    assert len(run.normalizer._clean) == 10  # vLLM's own kinds only
    assert len(run.normalizer.kinds.known()) == MAX_GROUP_ID + 1
    assert len(subjects._groups) == MAX_GROUP_ID + 1
    assert len(catalog.entry(worker="w", topic="", subject_prefix="kv", ranks=[0], started_at=0.0,
                             heartbeat_interval=1.0).groups) == MAX_GROUP_ID + 1
    assert run.stats.malformed[BAD_GROUP] == 3000 - (MAX_GROUP_ID + 1)


def test_a_pinned_group_above_the_bound_is_a_configuration_error() -> None:
    assert parse_group_kind(f"{MAX_GROUP_ID}=mamba") == (MAX_GROUP_ID, "mamba")
    with pytest.raises(ValueError, match="above"):
        parse_group_kind(f"{MAX_GROUP_ID + 1}=mamba")
