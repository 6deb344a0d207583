"""Payload format detection and --since parsing."""

from __future__ import annotations

import datetime as dt

import msgspec
import pytest

from bridge.client.codec import BusCodec, BusDecodeError
from bridge.client.subscribe import StartAt, consumer_config, parse_since
from bridge.contract import GroupMessage, WorkerRecord
from bridge.residency.hashes import as_int, lookup_keys
from tests.client.builders import hb, msg, record, stored

GROUP = msg([stored([hb(0), hb(1)])], seq=7)
RECORD = record("gap", gap=(3, 4))


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("with_header", [True, False])
def test_either_format_decodes_with_or_without_the_header(fmt: str, with_header: bool) -> None:
    encode = msgspec.msgpack.encode if fmt == "msgpack" else msgspec.json.encode
    headers = {"Kvb-Format": fmt} if with_header else {}
    codec = BusCodec()
    got = codec.decode("kv.w.0", headers, encode(GROUP))
    assert isinstance(got, GroupMessage) and got == GROUP
    rec = codec.decode("kv.w.worker", headers, encode(RECORD))
    assert isinstance(rec, WorkerRecord) and rec == RECORD


def test_record_header_wins_over_the_subject() -> None:
    data = msgspec.msgpack.encode(RECORD)
    assert isinstance(BusCodec().decode("elsewhere.x", {"Kvb-Record": "gap"}, data), WorkerRecord)


@pytest.mark.parametrize("data", [b"", b"\xc1", b'{"v": 1}', msgspec.msgpack.encode([1, 2])])
def test_garbage_is_a_decode_error(data: bytes) -> None:
    with pytest.raises(BusDecodeError):
        BusCodec().decode("kv.w.0", {}, data)


def test_int_form_is_the_low_64_bits_big_endian() -> None:
    h = bytes(range(32))
    assert as_int(h) == int.from_bytes(h, "big") & (2**64 - 1)
    assert lookup_keys(h) == (h, as_int(h))
    assert lookup_keys(5) == (5,)


def test_parse_since() -> None:
    assert parse_since("all") == StartAt("all")
    assert parse_since("42") == StartAt("seq", seq=42)
    assert parse_since("10m", now=1000.0) == StartAt("time", time=400.0)
    assert parse_since("1.5h", now=10000.0) == StartAt("time", time=10000.0 - 5400.0)
    assert parse_since("2025-01-31T12:00:00Z").time == dt.datetime(2025, 1, 31, 12, tzinfo=dt.UTC).timestamp()
    for bad in ("0", "-5m", "yesterday", "10x"):
        with pytest.raises(ValueError):
            parse_since(bad)


def test_consumer_config_per_policy() -> None:
    assert consumer_config(StartAt("seq", seq=9)).opt_start_seq == 9
    when = consumer_config(StartAt("time", time=0.0)).opt_start_time
    assert when == dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    assert consumer_config(StartAt("all")).deliver_policy is not None
