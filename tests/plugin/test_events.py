"""The tracker's events before and after the patch, on vLLM 0.33.0's real classes.

Geometry of the default hybrid: 16 tokens per hash, 32-token blocks, 2 blocks
per chunk, so a 64-token chunk has hashes h[4c..4c+3] and its attention event
carries the block hashes [h[4c+1], h[4c+3]].
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import overload

import msgspec
import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, ExternalBlockHash, maybe_convert_block_hash  # noqa: E402
from vllm.v1.kv_offload.base import Locality, Medium  # noqa: E402

from bridge.plugin import patch  # noqa: E402

from .hybrid import (  # noqa: E402
    ATTENTION,
    MAMBA,
    WINDOW,
    Hybrid,
    build_hybrid,
    chunk_key,
    make_request,
    patched_events,
    record_chunks,
    removed,
    store_events,
    stored,
    tail_key,
)

CHUNK_TOKENS = 64
NUM_CHUNKS = 3


@overload
def conv(block_hash: BlockHash) -> ExternalBlockHash: ...
@overload
def conv(block_hash: None) -> None: ...
def conv(block_hash: BlockHash | None) -> ExternalBlockHash | None:
    return None if block_hash is None else maybe_convert_block_hash(block_hash)


def block_stored(
    hashes: Sequence[BlockHash],
    parent: BlockHash | None,
    *,
    group_idx: int,
    kind: str | None,
    block_size: int,
    tokens: Sequence[int] = (),
    window: int | None = None,
    medium: str = "CPU",
    locality: str | None = None,
    ownership: str | None = None,
    lora: LoRARequest | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=[conv(h) for h in hashes],
        parent_block_hash=conv(parent),
        token_ids=list(tokens),
        block_size=block_size,
        lora_id=lora.adapter_id if lora else None,
        medium=medium,
        lora_name=lora.name if lora else None,
        group_idx=group_idx,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
        locality=locality,
        ownership=ownership,
    )


def attention_event(req, c: int, **kw) -> BlockStored:
    h = req.block_hashes
    return block_stored(
        [h[4 * c + 1], h[4 * c + 3]],
        h[4 * c - 1] if c else None,
        group_idx=ATTENTION,
        kind="full_attention",
        block_size=32,
        tokens=req.all_token_ids[c * CHUNK_TOKENS : (c + 1) * CHUNK_TOKENS],
        **kw,
    )


def placeholder(
    req, c: int, group_idx: int, kind: str, window: int | None = None, **kw
) -> BlockStored:
    return block_stored(
        [req.block_hashes[4 * c + 3]],
        None,
        group_idx=group_idx,
        kind=kind,
        block_size=0,
        window=window,
        **kw,
    )


def mamba_event(req, c: int, **kw) -> BlockStored:
    h = req.block_hashes
    # Parent: one 32-token block back, i.e. the attention event's second-to-last hash.
    return block_stored(
        [h[4 * c + 3]], h[4 * c + 1], group_idx=MAMBA, kind="mamba", block_size=32, **kw
    )


def encode(events: Sequence[KVCacheEvent]) -> list[bytes]:
    return [msgspec.msgpack.encode(event) for event in events]


def run_stores(
    hybrid: Hybrid, req, chunks: Sequence[int] = range(NUM_CHUNKS)
) -> list[BlockStored]:
    tracker = hybrid.new_tracker()
    keys = record_chunks(tracker, hybrid, req, chunks)
    return store_events(tracker.take_events([stored(keys)]))


@pytest.fixture
def hybrid() -> Hybrid:
    return build_hybrid()


@pytest.fixture
def req(hybrid: Hybrid):
    return make_request("r1", NUM_CHUNKS * CHUNK_TOKENS + 5, hybrid.tokens_per_hash)


def test_geometry_is_what_the_scheduler_builds(hybrid: Hybrid) -> None:
    groups = hybrid.groups
    assert hybrid.tokens_per_hash == 16
    for group in groups.values():
        assert (group.tokens_per_block, group.tokens_per_chunk, group.hashes_per_chunk) == (
            32,
            64,
            4,
        )
    assert type(groups[MAMBA].kv_cache_spec).__name__ == "MambaSpec"
    # The unpatched tracker skips every windowed group, Mamba included.
    assert groups[ATTENTION].sliding_window_size_in_chunks is None
    assert groups[MAMBA].sliding_window_size_in_chunks == 1
    assert groups[WINDOW].sliding_window_size_in_chunks is not None


def test_unpatched_tracker_emits_placeholders(hybrid: Hybrid, req, hash_mode: str) -> None:
    assert not patch.is_patched()
    events = run_stores(hybrid, req)
    assert events == [
        *(attention_event(req, c) for c in range(NUM_CHUNKS)),
        *(placeholder(req, c, MAMBA, "mamba") for c in range(NUM_CHUNKS)),
        *(placeholder(req, c, WINDOW, "sliding_window", window=64) for c in range(NUM_CHUNKS)),
    ]
    expected_type = int if hash_mode == "int" else bytes
    assert all(isinstance(h, expected_type) for e in events for h in e.block_hashes)


def test_patched_tracker_describes_mamba_chunks(hybrid: Hybrid, req, hash_mode: str) -> None:
    with patch.patched():
        events = run_stores(hybrid, req)
    assert events == [
        *(attention_event(req, c) for c in range(NUM_CHUNKS)),
        *(mamba_event(req, c) for c in range(NUM_CHUNKS)),
        *(placeholder(req, c, WINDOW, "sliding_window", window=64) for c in range(NUM_CHUNKS)),
    ]


def test_mamba_hash_and_parent_align_with_attention_chain(
    hybrid: Hybrid, req, hash_mode: str
) -> None:
    with patch.patched():
        events = run_stores(hybrid, req)
    attention = [e for e in events if e.group_idx == ATTENTION]
    mamba = [e for e in events if e.group_idx == MAMBA]
    assert len(attention) == len(mamba) == NUM_CHUNKS
    for att, state in zip(attention, mamba, strict=True):
        assert state.block_hashes == [att.block_hashes[-1]]
        assert state.parent_block_hash == att.block_hashes[-2]
        assert state.block_size == att.block_size
        assert state.token_ids == []
    # Each checkpoint hash is a node of the attention chain a consumer builds.
    chain = {h for att in attention for h in att.block_hashes}
    assert all(state.parent_block_hash in chain for state in mamba)


def test_single_block_chunks_take_the_previous_chunk_as_parent(hash_mode: str) -> None:
    hybrid = build_hybrid(block_size=64, blocks_per_chunk=1, with_window=False)
    req = make_request("r-one-block", 2 * 64 + 3, hybrid.tokens_per_hash)
    with patch.patched():
        events = run_stores(hybrid, req, chunks=range(2))
    attention = [e for e in events if e.group_idx == ATTENTION]
    mamba = [e for e in events if e.group_idx == MAMBA]
    h = req.block_hashes
    assert [e.block_hashes for e in attention] == [[conv(h[3])], [conv(h[7])]]
    assert mamba == [
        block_stored([h[3]], None, group_idx=MAMBA, kind="mamba", block_size=64),
        block_stored([h[7]], h[3], group_idx=MAMBA, kind="mamba", block_size=64),
    ]
    for att, state in zip(attention, mamba, strict=True):
        assert state.block_hashes == att.block_hashes
        assert state.parent_block_hash == att.parent_block_hash


def test_attention_and_window_events_are_byte_identical(
    hybrid: Hybrid, req, hash_mode: str
) -> None:
    before = run_stores(hybrid, req)
    with patch.patched():
        after = run_stores(hybrid, req)
    for group_idx in (ATTENTION, WINDOW):
        assert encode([e for e in after if e.group_idx == group_idx]) == encode(
            [e for e in before if e.group_idx == group_idx]
        )
    assert encode([e for e in after if e.group_idx == MAMBA]) != encode(
        [e for e in before if e.group_idx == MAMBA]
    )


def test_cpu_and_storage_lifecycle_is_symmetric_with_attention(
    hybrid: Hybrid, req, hash_mode: str
) -> None:
    h = req.block_hashes
    with patch.patched():
        tracker = hybrid.new_tracker()
        pending = tracker._pending_event_metadata
        a0, m0 = (
            chunk_key(req, hybrid.groups[ATTENTION], 0),
            chunk_key(req, hybrid.groups[MAMBA], 0),
        )
        record_chunks(tracker, hybrid, req, [0], group_ids=[ATTENTION, MAMBA])

        def same_residency() -> None:
            assert (a0 in pending) == (m0 in pending)
            if a0 in pending:
                assert pending[a0].active_residencies == pending[m0].active_residencies

        assert list(tracker.take_events([stored([a0, m0])])) == [
            attention_event(req, 0),
            mamba_event(req, 0),
        ]
        same_residency()

        # A secondary tier (storage) copies the chunk and will announce its removal.
        tier = dict(locality=Locality.LOCAL, ownership="kvcr", removal_expected=True)
        at_tier = dict(medium="STORAGE", locality="LOCAL", ownership="kvcr")
        assert list(tracker.take_events([stored([a0, m0], Medium.STORAGE, **tier)])) == [
            attention_event(req, 0, **at_tier),
            mamba_event(req, 0, **at_tier),
        ]
        same_residency()

        # CPU eviction: one removal per group, the Mamba one at its single hash.
        assert list(tracker.take_events([removed([a0, m0])])) == [
            BlockRemoved(block_hashes=[conv(h[1]), conv(h[3])], medium="CPU", group_idx=ATTENTION),
            BlockRemoved(block_hashes=[conv(h[3])], medium="CPU", group_idx=MAMBA),
        ]
        assert a0 in pending and m0 in pending  # storage still holds both
        same_residency()

        # Promotion back to CPU after a primary-tier lookup hit.
        tracker.record_lookup(req, hybrid.groups[ATTENTION], 0, a0)
        tracker.record_lookup(req, hybrid.groups[MAMBA], 0, m0)
        assert list(tracker.take_events([stored([a0, m0])])) == [
            attention_event(req, 0),
            mamba_event(req, 0),
        ]
        same_residency()

        assert list(
            tracker.take_events(
                [removed([m0, a0], Medium.STORAGE, locality=Locality.LOCAL, ownership="kvcr")]
            )
        ) == [
            BlockRemoved(
                block_hashes=[conv(h[3])],
                medium="STORAGE",
                group_idx=MAMBA,
                locality="LOCAL",
                ownership="kvcr",
            ),
            BlockRemoved(
                block_hashes=[conv(h[1]), conv(h[3])],
                medium="STORAGE",
                group_idx=ATTENTION,
                locality="LOCAL",
                ownership="kvcr",
            ),
        ]
        same_residency()

        assert len(list(tracker.take_events([removed([a0, m0])]))) == 2
        assert a0 not in pending and m0 not in pending  # last residency gone: forgotten
        # Forgotten keys fall back to vLLM's placeholder, as for attention.
        assert list(tracker.take_events([stored([m0])])) == [placeholder(req, 0, MAMBA, "mamba")]


def test_one_removal_spanning_groups_splits_by_group(hybrid: Hybrid, req, hash_mode: str) -> None:
    h = req.block_hashes
    with patch.patched():
        tracker = hybrid.new_tracker()
        keys = record_chunks(tracker, hybrid, req, range(2))
        list(tracker.take_events([stored(keys)]))
        assert list(tracker.take_events([removed(keys)])) == [
            BlockRemoved(
                block_hashes=[conv(x) for x in (h[1], h[3], h[5], h[7])],
                medium="CPU",
                group_idx=ATTENTION,
            ),
            BlockRemoved(block_hashes=[conv(h[3]), conv(h[7])], medium="CPU", group_idx=MAMBA),
            BlockRemoved(block_hashes=[conv(h[3]), conv(h[7])], medium="CPU", group_idx=WINDOW),
        ]
        assert tracker._pending_event_metadata == {}


def test_failed_allocation_releases_quietly(hybrid: Hybrid, req, bytes_hashes: None) -> None:
    with patch.patched():
        tracker = hybrid.new_tracker()
        keys = record_chunks(tracker, hybrid, req, [0], group_ids=[ATTENTION, MAMBA])
        assert list(tracker.take_events([removed(keys, metadata_only=True)])) == []
        assert tracker._pending_event_metadata == {}


def test_lookup_alone_registers_the_checkpoint(hybrid: Hybrid, req, hash_mode: str) -> None:
    with patch.patched():
        tracker = hybrid.new_tracker()
        for group_idx in (ATTENTION, MAMBA, WINDOW):
            group = hybrid.groups[group_idx]
            tracker.record_lookup(req, group, 1, chunk_key(req, group, 1))
        keys = [chunk_key(req, hybrid.groups[g], 1) for g in (ATTENTION, MAMBA, WINDOW)]
        assert list(tracker.take_events([stored(keys)])) == [
            attention_event(req, 1),
            mamba_event(req, 1),
            placeholder(req, 1, WINDOW, "sliding_window", window=64),
        ]
        list(tracker.take_events([removed(keys)]))
        assert tracker._pending_event_metadata == {}


def test_partial_tail_follows_the_same_rule(hash_mode: str) -> None:
    # The geometry the scheduler allows partial tails for: one block per chunk,
    # blocks larger than a hash, no windowed attention.
    hybrid = build_hybrid(block_size=64, blocks_per_chunk=1, with_window=False)
    assert hybrid.config.supports_partial_tail
    tph = hybrid.tokens_per_hash
    req = make_request("r-tail", 100, tph)
    h = req.block_hashes
    boundary = 96  # 2 hashes into chunk 1

    def drive(record: str) -> tuple[list[BlockStored], list[KVCacheEvent]]:
        tracker = hybrid.new_tracker()
        keys = []
        for group_idx in (ATTENTION, MAMBA):
            group = hybrid.groups[group_idx]
            key = tail_key(req, group, boundary, tph)
            getattr(tracker, record)(req, group, boundary, key)
            keys.append(key)
        return store_events(tracker.take_events([stored(keys)])), list(tracker.take_events([removed(keys)]))

    attention_tail = block_stored(
        [h[4], h[5]],
        h[3],
        group_idx=ATTENTION,
        kind="full_attention",
        block_size=16,
        tokens=req.all_token_ids[64:96],
    )
    before, _ = drive("record_partial_store")
    assert before == [
        attention_tail,
        block_stored([h[5]], None, group_idx=MAMBA, kind="mamba", block_size=0),
    ]

    mamba_tail = block_stored([h[5]], h[4], group_idx=MAMBA, kind="mamba", block_size=16)
    with patch.patched():
        for record in ("record_partial_store", "record_partial_lookup"):
            stores, removals = drive(record)
            assert stores == [attention_tail, mamba_tail]
            assert stores[1].block_hashes == [stores[0].block_hashes[-1]]
            assert stores[1].parent_block_hash == stores[0].block_hashes[-2]
            assert removals[1] == BlockRemoved(
                block_hashes=[conv(h[5])], medium="CPU", group_idx=MAMBA
            )


def test_partial_lookup_keeps_an_existing_entry(bytes_hashes: None) -> None:
    hybrid = build_hybrid(block_size=64, blocks_per_chunk=1, with_window=False)
    req = make_request("r-tail", 100, hybrid.tokens_per_hash)
    group = hybrid.groups[MAMBA]
    key = tail_key(req, group, 96, hybrid.tokens_per_hash)
    with patch.patched():
        tracker = hybrid.new_tracker()
        tracker.record_partial_store(req, group, 96, key)
        meta = tracker._pending_event_metadata[key]
        tracker.record_partial_lookup(req, group, 96, key)
        assert tracker._pending_event_metadata[key] is meta


def test_reset_forgets_everything(hybrid: Hybrid, req, hash_mode: str) -> None:
    with patch.patched():
        tracker = hybrid.new_tracker()
        keys = record_chunks(tracker, hybrid, req, range(NUM_CHUNKS))
        tracker.reset()
        assert tracker._pending_event_metadata == {}
        events = store_events(tracker.take_events([stored(keys)]))
    assert [e.block_size for e in events] == [0] * len(keys)  # all placeholders now
    assert [e for e in events if e.group_idx == MAMBA] == [
        placeholder(req, c, MAMBA, "mamba") for c in range(NUM_CHUNKS)
    ]


@pytest.mark.parametrize(
    ("self_describing", "enable_events"),
    [(False, True), (True, False)],
    ids=["opt-out", "events-off"],
)
def test_inert_tracker_stays_inert(
    self_describing: bool, enable_events: bool, bytes_hashes: None
) -> None:
    hybrid = build_hybrid(self_describing=self_describing, enable_kv_cache_events=enable_events)
    req = make_request("r-off", 2 * CHUNK_TOKENS, hybrid.tokens_per_hash)
    before = run_stores(hybrid, req, range(2))
    with patch.patched():
        after = run_stores(hybrid, req, range(2))
    assert encode(after) == encode(before)
    assert all(e.block_size == 0 and e.kv_cache_spec_kind is None for e in after)


def test_lora_fields_match_the_attention_event(bytes_hashes: None) -> None:
    hybrid = build_hybrid()
    lora = LoRARequest("adapter-a", 7, "/nonexistent")
    req = make_request("r-lora", 2 * CHUNK_TOKENS, hybrid.tokens_per_hash, lora=lora)
    with patch.patched():
        events = run_stores(hybrid, req, range(1))
    assert events[0] == attention_event(req, 0, lora=lora)
    assert events[1] == mamba_event(req, 0, lora=lora)


def test_unplaceable_chunk_keeps_the_placeholder_and_warns_once(
    hybrid: Hybrid, req, bytes_hashes: None, caplog: pytest.LogCaptureFixture
) -> None:
    group = hybrid.groups[MAMBA]
    wrong_key = chunk_key(req, group, 1)  # key of chunk 1 recorded as chunk 0
    with patch.patched(), caplog.at_level(logging.WARNING, logger="kv_bridge.plugin"):
        tracker = hybrid.new_tracker()
        tracker.record_store(req, group, 0, wrong_key)
        tracker.record_store(req, group, 99, chunk_key(req, group, 2))  # beyond the hashes
        tracker.record_lookup(req, group, 99, chunk_key(req, group, 2))
        events = list(tracker.take_events([stored([wrong_key, chunk_key(req, group, 2)])]))
    assert events == [placeholder(req, 1, MAMBA, "mamba"), placeholder(req, 2, MAMBA, "mamba")]
    warnings = [r for r in caplog.records if r.name == "kv_bridge.plugin"]
    assert len(warnings) == 1 and "placeholder" in warnings[0].getMessage()


def test_helper_for_end_to_end(hash_mode: str) -> None:
    run = patched_events(2)
    assert not patch.is_patched()
    by_group = {g: [e for e in run.events if e.group_idx == g] for g in (ATTENTION, MAMBA, WINDOW)}
    assert [e.kv_cache_spec_kind for e in by_group[MAMBA]] == ["mamba", "mamba"]
    for att, state in zip(by_group[ATTENTION], by_group[MAMBA], strict=True):
        assert state.block_hashes == [att.block_hashes[-1]]
    assert all(e.block_size == 0 for e in by_group[WINDOW])
