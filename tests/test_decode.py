from typing import cast

import msgspec

from bridge.apps.demo.wire_writer import cleared, encode_batch, removed, stored
from bridge.contract import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from bridge.producer.decode.decoder import BatchDecodeError, BatchDecoder

enc = msgspec.msgpack.Encoder().encode


def test_decodes_a_hybrid_batch_with_bytes_and_int_hashes() -> None:
    h: list[BlockHash] = [b"\x01" * 32, b"\x02" * 32]
    payload = encode_batch(
        12.5,
        [
            stored(h, None, list(range(32)), 16, group_idx=0, kind="full_attention"),
            stored([7, 8], 6, [], 16, group_idx=2, kind="mamba"),
            removed([h[0]], group_idx=0),
            cleared(),
        ],
        dp_rank=1,
    )
    batch = BatchDecoder().decode(payload)
    assert batch.ts == 12.5 and batch.dp_rank == 1 and batch.rejected == []
    assert [type(e) for e in batch.events] == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    assert isinstance(batch.events[0], BlockStored) and isinstance(batch.events[1], BlockStored)
    assert batch.events[0].block_hashes == h
    assert batch.events[1].block_hashes == [7, 8] and batch.events[1].parent_block_hash == 6


def test_tolerates_unknown_keys_extra_array_fields_and_legacy_events() -> None:
    future = msgspec.msgpack.decode(msgspec.msgpack.encode(stored([b"x"], None, [1], 16, group_idx=1, kind="sliding_window")))
    future["brand_new_field"] = {"nested": [1, 2]}
    legacy = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1, 2],
              "block_size": 2, "lora_id": None, "medium": "GPU"}
    payload = enc([1.0, [future, legacy], 0, "extra-array-field", 42])
    batch = BatchDecoder().decode(payload)
    assert batch.rejected == []
    assert isinstance(batch.events[0], BlockStored) and isinstance(batch.events[1], BlockStored)
    assert batch.events[0].kv_cache_spec_kind == "sliding_window"
    assert batch.events[1].group_idx is None and batch.events[1].kv_cache_spec_kind is None


def test_one_bad_event_is_skipped_and_the_rest_survive() -> None:
    good1 = stored([b"a"], None, [1], 16, group_idx=0, kind="full_attention")
    bad_type = {"type": "BlockStored", "block_hashes": "not-a-list"}
    unknown = {"type": "BlockPromoted", "block_hashes": [1]}
    not_a_map = 17
    good2 = removed([b"a"], group_idx=0)
    batch = BatchDecoder().decode(enc([2.0, [good1, bad_type, unknown, not_a_map, good2]]))
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved]
    reasons = sorted(r for r, _ in batch.rejected)
    assert reasons == ["bad_event", "bad_event", "unknown_event_type"]
    assert ("unknown_event_type", "BlockPromoted") in batch.rejected


def test_a_payload_that_is_no_batch_raises_a_classified_error() -> None:
    decoder = BatchDecoder()
    for payload in [b"", b"\xc1", enc({"ts": 1}), enc(["x", []]), b"\x92\xcb" + b"\x00" * 3]:
        try:
            decoder.decode(payload)
        except BatchDecodeError as exc:
            assert exc.reason == "bad_batch"
            continue
        raise AssertionError(f"decoded {payload!r}")


def test_relay_keeps_token_ids_as_the_publisher_encoded_them() -> None:
    from bridge.contract import GroupMessage
    from bridge.producer.decode.wire import RelayBlockStored

    tokens = [0, 127, 128, 70_000, 2**40]
    payload = encode_batch(3.0, [stored([b"\x01" * 32], None, tokens, 16, group_idx=0, kind="full_attention")])
    batch = BatchDecoder(relay=True).decode(payload)
    event = batch.events[0]
    assert type(event) is RelayBlockStored and batch.rejected == []
    assert bytes(event.token_ids) == msgspec.msgpack.encode(tokens)
    # What consumers decode from the relayed bytes is what vLLM sent.
    msg = GroupMessage(v=1, worker="w", dp_rank=0, epoch=1, seq=0, ts=3.0, group=0, kind="full_attention",
                       family="attention", kind_source="event", events=[event])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=GroupMessage)
    assert back.events[0].token_ids == tokens  # type: ignore[union-attr]


def test_token_ids_that_are_no_array_cost_only_their_event() -> None:
    good = stored([b"\x02" * 32], None, [1, 2], 16, group_idx=0, kind="full_attention")
    bad = msgspec.msgpack.decode(msgspec.msgpack.encode(good))
    bad["token_ids"] = "not tokens"
    for relay in (True, False):
        batch = BatchDecoder(relay=relay).decode(enc([1.0, [bad, good]]))
        assert len(batch.events) == 1 and isinstance(batch.events[0], BlockStored)
        assert batch.events[0].block_hashes == [b"\x02" * 32]
        assert [reason for reason, _ in batch.rejected] == ["bad_event"]


def test_relay_leaves_token_elements_to_the_publisher_json_checks_them() -> None:
    """The documented trade: relaying token ids undecoded checks that they are
    an array, not what each element is; the JSON output decodes them and does."""
    odd = msgspec.msgpack.decode(msgspec.msgpack.encode(stored([b"\x03" * 32], None, [1], 16, group_idx=0)))
    odd["token_ids"] = [1, "two"]
    payload = enc([1.0, [odd]])
    assert len(BatchDecoder(relay=True).decode(payload).events) == 1
    typed = BatchDecoder(relay=False).decode(payload)
    assert typed.events == [] and [reason for reason, _ in typed.rejected] == ["bad_event"]


def test_array_events_of_the_oldest_releases_decode_into_the_same_structs() -> None:
    """vLLM 0.9.0: `[ts, events]`, events `[tag, field, ...]`, Python hash()
    ints that may be negative, no medium, no group."""
    tokens = [1, 2, 3, 4]
    payload = enc([4.0, [["BlockStored", [-5, 9], None, tokens, 2, None], ["BlockRemoved", [-5]], ["AllBlocksCleared"]]])
    for relay in (False, True):
        batch = BatchDecoder(relay=relay).decode(payload)
        assert batch.rejected == [] and batch.dp_rank is None and batch.ts == 4.0
        store, removal, clear = batch.events
        assert isinstance(store, BlockStored) and store.block_hashes == [-5, 9] and store.block_size == 2
        # the relay leaves token ids undecoded (msgspec.Raw)
        got = msgspec.msgpack.decode(cast(msgspec.Raw, store.token_ids)) if relay else store.token_ids
        assert got == tokens
        assert store.medium is None and store.group_idx is None and store.kv_cache_spec_kind is None
        assert type(removal) is BlockRemoved and removal.block_hashes == [-5] and removal.medium is None
        assert type(clear) is AllBlocksCleared


def test_array_events_carry_every_field_their_release_appended() -> None:
    """vLLM 0.22/0.23: every positional field, plus a later one this bridge
    does not know (ignored), and uint64 hashes at and above 2**63."""
    big = [2**63, 2**64 - 1]
    store = ["BlockStored", big, 7, [9] * 32, 16, 3, "CPU", "adapter", [None, ["k", 1]], 2, "mamba", None, "future"]
    removal = ["BlockRemoved", big[:1], "CPU", 2, "future"]
    batch = BatchDecoder().decode(enc([5.0, [store, removal], 1]))
    assert batch.rejected == [] and batch.dp_rank == 1
    s, r = batch.events
    assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved)
    assert (s.block_hashes, s.parent_block_hash, s.block_size, s.lora_id, s.medium, s.lora_name) == (
        big, 7, 16, 3, "CPU", "adapter")
    assert (s.extra_keys, s.group_idx, s.kv_cache_spec_kind) == ([None, ["k", 1]], 2, "mamba")
    assert (r.block_hashes, r.medium, r.group_idx) == ([2**63], "CPU", 2)


def test_a_publisher_switching_encodings_keeps_decoding() -> None:
    """The decoder tries the form it saw last first; either form still decodes
    when the other comes (a vLLM upgraded behind the same endpoint)."""
    decoder = BatchDecoder(relay=True)
    as_map = encode_batch(1.0, [stored([b"\x01" * 32], None, [1], 16, group_idx=0, kind="full_attention")])
    as_array = enc([2.0, [["BlockStored", [b"\x01" * 32], None, [1], 16, None, "GPU"]]])
    for payload in (as_map, as_array, as_array, as_map, as_array):
        batch = decoder.decode(payload)
        assert batch.rejected == [] and [cast(BlockStored, e).block_hashes for e in batch.events] == [[b"\x01" * 32]]


def test_one_bad_array_event_costs_only_itself() -> None:
    good = ["BlockStored", [1], None, [1, 2], 2, None, "GPU"]
    batch = BatchDecoder().decode(enc([1.0, [good, ["BlockStored", "no list"], ["BlockPromoted", [1]], good]]))
    assert len(batch.events) == 2
    assert sorted(r for r, _ in batch.rejected) == ["bad_event", "unknown_event_type"]


def test_relayed_events_keep_every_field_vllm_requires() -> None:
    """A map store that lacks fields vLLM always sends is decoded with vLLM's
    defaults and relayed with all of them, so vLLM's own structs read it."""
    lean = {"type": "BlockStored", "block_hashes": [5], "block_size": 16}
    for relay in (False, True):
        event = BatchDecoder(relay=relay).decode(enc([1.0, [lean, {"type": "BlockRemoved", "block_hashes": [5]}]])).events
        fields = [msgspec.msgpack.decode(msgspec.msgpack.encode(e)) for e in event]
        assert fields[0] == {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [],
                             "block_size": 16, "lora_id": None, "medium": None, "lora_name": None}
        assert fields[1] == {"type": "BlockRemoved", "block_hashes": [5], "medium": None}


def test_array_elements_past_the_last_array_field_are_ignored_not_taken_for_map_fields() -> None:
    """Positions 12 and on were never sent in array form: a publisher that
    puts something there (here a `placeholder` flag, the bridge's own word)
    changes nothing."""
    store = ["BlockStored", [1], None, [1], 16, None, "GPU", None, None, 1, "sliding_window", 32,
             "REMOTE", "tier", "session", [[1]], True, "more"]
    removal = ["BlockRemoved", [1], "GPU", 1, "REMOTE", "tier"]
    for relay in (False, True):
        s, r = BatchDecoder(relay=relay).decode(enc([1.0, [store, removal]])).events
        relayed = msgspec.msgpack.decode(msgspec.msgpack.encode(s))
        assert set(relayed) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                "medium", "lora_name", "group_idx", "kv_cache_spec_kind",
                                "kv_cache_spec_sliding_window"}
        assert set(msgspec.msgpack.decode(msgspec.msgpack.encode(r))) == {"type", "block_hashes", "medium", "group_idx"}


def test_array_events_become_the_same_structs_with_or_without_retyping() -> None:
    """The class swap and the fallback that builds each event anew agree."""
    from bridge.producer.decode.arrays import RETYPE, ArrayRelayEventBatch, as_map_events

    assert RETYPE, "this Python and msgspec allow the class swap; the fallback is for those that do not"
    payload = enc([1.0, [["BlockStored", [2**64 - 1], -3, [5, 6], 2, 1, "CPU", "l", [None], 2, "mamba", None, "x"],
                         ["BlockRemoved", [7], "CPU", 2, "x"], ["AllBlocksCleared", "x"]], 3])
    decode = msgspec.msgpack.Decoder(ArrayRelayEventBatch).decode
    swapped = as_map_events(decode(payload).events, retype=True)
    rebuilt = as_map_events(decode(payload).events, retype=False)
    assert [type(e) for e in swapped] == [type(e) for e in rebuilt]
    assert [msgspec.msgpack.encode(e) for e in swapped] == [msgspec.msgpack.encode(e) for e in rebuilt]
