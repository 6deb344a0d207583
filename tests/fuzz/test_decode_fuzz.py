"""Hypothesis over vLLM's wire structs: the decoder raises nothing but
BatchDecodeError, good events survive their bad neighbours, and whatever it
lets through the normalizer and both encoders take without an exception and
without anything unsafe reaching a subject or a header."""

from __future__ import annotations

import math
import os
import re
import time
from collections import Counter
from typing import Any

import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bridge.contract import (
    FAMILY_OF_KIND,
    MAX_GROUP_ID,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    GroupMessage,
    WorkerRecord,
    decoder_for,
)
from bridge.producer.decode.decoder import BatchDecodeError, BatchDecoder, DecodedBatch
from bridge.producer.normalize.normalizer import (
    MAX_MESSAGES_PER_BATCH,
    KindBook,
    Normalizer,
    NormalizeStats,
    StreamIdentity,
)
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from tests.fuzz.strategies import any_junk, json_junk, mixed_batch

EXAMPLES = int(os.environ.get("KVB_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])

DECODER = BatchDecoder()
_SAFE_HEADER = re.compile(r"^[\x21-\x7e]*$")  # visible ASCII, no CR/LF, no spaces
_TOKEN = re.compile(r"^[A-Za-z0-9_~-]+$")
_SAFE_KIND = re.compile(r"^[a-z0-9_]{1,48}$")
_KNOWN = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def decode_or_classified(payload: bytes) -> DecodedBatch | None:
    try:
        return DECODER.decode(payload)
    except BatchDecodeError as exc:
        assert exc.reason == "bad_batch"
        return None


@FUZZ
@given(st.binary(max_size=3000))
@example(b"")
@example(b"\xc1")
@example(b"\xdd\xff\xff\xff\xff")  # array32 claiming 4 G elements, none there
@example(b"\xc6\xff\xff\xff\xff")  # bin32 claiming 4 GB
@example(b"\x92\xcb" + b"\x00" * 3)
def test_any_bytes_decode_or_raise_batch_decode_error(payload: bytes) -> None:
    decode_or_classified(payload)


@FUZZ
@given(any_junk)
def test_any_msgpack_value_decodes_or_raises_batch_decode_error(value: Any) -> None:
    decode_or_classified(msgspec.msgpack.encode(value))


@FUZZ
@given(st.lists(any_junk, max_size=4), any_junk)
def test_any_batch_shaped_junk_decodes_or_raises_batch_decode_error(events: list[Any], ts: Any) -> None:
    for value in ([ts, events], [ts, events, ts], [1.0, events], {"ts": 1.0, "events": events}, [ts]):
        decode_or_classified(msgspec.msgpack.encode(value))


def _same_event(decoded: Any, original: dict[str, Any]) -> bool:
    if type(decoded) is not _KNOWN[original["type"]]:
        return False
    if isinstance(decoded, (BlockStored, BlockRemoved)):
        return decoded.block_hashes == original["block_hashes"]
    return True


@FUZZ
@given(mixed_batch())
def test_good_events_survive_their_bad_neighbours(case: tuple[bytes, list[dict[str, Any]], list[str]]) -> None:
    payload, good, bad_reasons = case
    batch = decode_or_classified(payload)
    assert batch is not None, "a batch with a valid frame must decode"
    assert len(batch.events) == len(good)
    assert all(_same_event(d, g) for d, g in zip(batch.events, good))
    assert Counter(r for r, _ in batch.rejected) == Counter(bad_reasons)
    assert all(len(detail) <= 200 for _, detail in batch.rejected)


def _headers_and_subjects_are_safe(subject: str, headers: dict[str, str], prefix_tokens: int) -> None:
    tokens = subject.split(".")
    assert len(tokens) == prefix_tokens + 2, subject
    assert all(_TOKEN.match(t) for t in tokens), subject
    for key, value in headers.items():
        assert _SAFE_HEADER.match(key) and _SAFE_HEADER.match(value), (key, value)


def _run_normalizer_and_encoders(payload: bytes, formats: tuple[str, ...], pinned: dict[int, str],
                                 keep_placeholders: bool) -> None:
    batch = decode_or_classified(payload)
    if batch is None:
        return
    normalizer = Normalizer(KindBook(pinned), keep_placeholders)
    ident = StreamIdentity(worker="pod.a b*>\u00e9", dp_rank=1, topic="t", epoch=1)
    stats = NormalizeStats()
    items = normalizer.normalize(ident, 7, batch.ts, batch.events, time.time(), stats)
    # every event is accounted for: published, dropped on purpose or rejected, and counted
    published = sum(len(i.events) for i in items if isinstance(i, GroupMessage))
    records = sum(1 for i in items if isinstance(i, WorkerRecord))
    dropped = stats.dropped["window_placeholder"] + stats.dropped["state_no_hash"]
    assert published + dropped + records + stats.dropped["repeated_clear"] + sum(stats.malformed.values()) \
        == len(batch.events)
    assert len(items) <= MAX_MESSAGES_PER_BATCH
    for item in items:
        if isinstance(item, GroupMessage):
            assert 0 <= item.group <= MAX_GROUP_ID
            if item.family == "state":
                # a state event names its checkpoint and carries no tokens; a
                # hash-less one is the group's shape store, its slice's only event
                assert all((e.block_hashes or item.events == [e]) and not e.token_ids
                           and e.lookahead_token_ids is None
                           for e in item.events if isinstance(e, BlockStored))
    subjects = SubjectBook("kv.prod", ident.worker, ident.dp_rank)
    for fmt in formats:
        encoder = MessageEncoder(fmt)
        group_decoder = decoder_for(fmt, GroupMessage)
        record_decoder = decoder_for(fmt, WorkerRecord)
        for n, item in enumerate(items):
            if isinstance(item, GroupMessage):
                assert _SAFE_KIND.match(item.kind) and item.family in ("attention", "window", "state", "other")
                out = encoder.group(item, subjects, "tok:1:1")
                back = group_decoder.decode(out.payload)
                assert back.seq == 7 and back.group == item.group and len(back.events) == len(item.events)
            else:
                out = encoder.record(item, subjects, f"tok:1:1:7:worker:cleared{n}")
                assert record_decoder.decode(out.payload).type == "cleared"
            _headers_and_subjects_are_safe(out.subject, out.headers, 2)


pins = st.dictionaries(st.integers(0, 4), st.sampled_from(sorted(FAMILY_OF_KIND)), max_size=2)


@FUZZ
@given(mixed_batch(), pins, st.booleans())
def test_normalizer_and_msgpack_encoder_take_any_decoded_batch(
    case: tuple[bytes, list[dict[str, Any]], list[str]], pinned: dict[int, str], keep: bool
) -> None:
    _run_normalizer_and_encoders(case[0], ("msgpack",), pinned, keep)


@FUZZ
@given(mixed_batch(extra=json_junk), pins, st.booleans())
def test_normalizer_and_json_encoder_take_json_representable_junk(
    case: tuple[bytes, list[dict[str, Any]], list[str]], pinned: dict[int, str], keep: bool
) -> None:
    payload = case[0]
    batch = decode_or_classified(payload)
    if batch is not None and not math.isfinite(batch.ts):
        return  # JSON writes null: test_non_finite_ts_reaches_json_consumers_intact
    _run_normalizer_and_encoders(payload, ("json",), pinned, keep)


def _nested_payload(depth: int) -> bytes:
    """One BlockStored whose extra_keys nest `depth` arrays deep: ~depth bytes."""
    enc = msgspec.msgpack.encode
    event = (b"\x83" + enc("type") + enc("BlockStored") + enc("block_hashes") + enc([b"h"]) + enc("extra_keys")
             + b"\x91" * depth + b"\xc0")
    return b"\x92" + enc(1.0) + b"\x92" + event + enc({"type": "BlockRemoved", "block_hashes": [b"g"]})


def test_moderate_nesting_is_kept() -> None:
    batch = DECODER.decode(_nested_payload(200))
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved]


def test_deep_nesting_is_rejected_not_raised() -> None:
    """msgspec answers ~1000 levels of nesting with RecursionError: the decoder
    must turn that into a rejection (found failing at c8eb558: it escaped)."""
    try:
        batch = DECODER.decode(_nested_payload(5000))
    except BatchDecodeError:
        return
    # the better outcome: the deep event rejected, its neighbour kept
    assert [r for r, _ in batch.rejected] == ["bad_event"]
    assert [type(e) for e in batch.events] == [BlockRemoved]


def test_non_finite_ts_reaches_json_consumers_intact() -> None:
    """msgspec.json writes NaN/inf as null, which the contract's GroupMessage
    (ts: float) cannot read back. Found failing at c8eb558 (consumers of a JSON
    bridge lost such messages); refusing the batch as bad_batch is fine."""
    enc = msgspec.msgpack.encode
    for ts in (float("nan"), float("inf"), float("-inf")):
        payload = enc([ts, [{"type": "BlockStored", "block_hashes": [b"h"], "group_idx": 0,
                             "kv_cache_spec_kind": "full_attention", "block_size": 16}]])
        try:
            batch = DECODER.decode(payload)
        except BatchDecodeError:
            continue  # refused: counted as bad_batch, nothing unreadable published
        items = Normalizer(KindBook({}), False).normalize(
            StreamIdentity("w", 0, "", 1), 0, batch.ts, batch.events, time.time(), NormalizeStats())
        assert isinstance(items[0], GroupMessage)
        out = MessageEncoder("json").group(items[0], SubjectBook("kv", "w", 0), "w:0:1")
        decoder_for("json", GroupMessage).decode(out.payload)
