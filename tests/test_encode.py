"""The publisher writes HPUB frames itself: their bytes must be what NATS and
nats-py would make of the same subject, reply and headers; and the ids
framing gives records."""

from __future__ import annotations

import msgspec
import structlog

from bridge.contract import BlockRemoved, GroupMessage, WorkerRecord
from bridge.producer.normalize.normalizer import StreamIdentity
from bridge.producer.sink.encode import KEPT_BUFFER_BYTES, MessageEncoder, Outgoing, hpub_frames
from bridge.producer.sink.framing import Framing
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.telemetry.metrics import Metrics


def _parse_head(head: bytes) -> dict[str, str]:
    lines = head.decode().split("\r\n")
    assert lines[0] == "NATS/1.0" and lines[-2:] == ["", ""]
    return dict(line.split(": ", 1) for line in lines[1:-2])


def _group(kind: str, family: str, seq: int, part: int = 0) -> GroupMessage:
    return GroupMessage(v=1, worker="w", dp_rank=0, epoch=9, seq=seq, ts=1.0, group=2, kind=kind, family=family,
                        kind_source="event", events=[], part=part)


def test_prebuilt_head_carries_exactly_the_headers() -> None:
    enc = MessageEncoder("msgpack")
    book = SubjectBook("kv", "w", 0)
    outs = [enc.group(_group("mamba", "state", seq), book, "w:0:9") for seq in (1, 2)]
    outs.append(enc.group(_group("full_attention", "attention", 3, part=1), book, "w:0:9"))
    rec = WorkerRecord(v=1, worker="w", dp_rank=0, epoch=9, type="gap", ts=1.0, gap_from=1, gap_to=2)
    outs.append(enc.record(rec, book, "w:0:9:1-2:worker:gap"))
    for out in outs:
        assert _parse_head(out.head) == out.headers
    assert outs[0].headers["Nats-Msg-Id"] == "w:0:9:1:2" and outs[1].headers["Kvb-Seq"] == "2"
    assert outs[2].headers["Nats-Msg-Id"] == "w:0:9:3:2.p1" and outs[2].headers["Kvb-Kind"] == "full_attention"


def _parse_frames(data: bytes) -> list[tuple[list[str], dict[str, str], bytes]]:
    out = []
    while data:
        line, _, data = data.partition(b"\r\n")
        op, *args = line.decode().split(" ")
        assert op == "HPUB"
        hdr_len, total = int(args[-2]), int(args[-1])
        head, payload, rest = data[:hdr_len], data[hdr_len:total], data[total:]
        assert rest[:2] == b"\r\n"
        out.append((args[:-2], _parse_head(head), payload))
        data = rest[2:]
    return out


def test_hpub_frames_with_and_without_reply_subjects() -> None:
    enc = MessageEncoder("json")
    book = SubjectBook("kv", "w", 3)
    msgs: list[Outgoing] = [enc.group(_group("mamba", "state", seq), book, "w:3:9") for seq in range(3)]
    plain = _parse_frames(hpub_frames(msgs))
    assert [args for args, _, _ in plain] == [[book.group(2)]] * 3
    assert [payload for _, _, payload in plain] == [m.payload for m in msgs]
    replied = _parse_frames(hpub_frames(msgs, ["_INBOX.x.0", "_INBOX.x.1", "_INBOX.x.2"]))
    assert [args for args, _, _ in replied] == [[book.group(2), f"_INBOX.x.{i}"] for i in range(3)]
    assert [headers for _, headers, _ in replied] == [m.headers for m in msgs]


def _framing(clock: list[float]) -> Framing:
    ident = StreamIdentity("w", 0, "kv@w", 9)
    return Framing(0, ident, SubjectBook("kv", "w", 0), MessageEncoder("msgpack"), lambda: 1 << 20, Metrics(),
                   structlog.get_logger("test"), lambda: clock.pop(0))


def test_each_bridge_process_names_its_own_start_and_stop() -> None:
    """A bridge resumes the epoch and stops again with no batch between: its
    start and stop carry the seq its predecessor's did. Named by seq, the
    stream's duplicate window would take them for copies and drop them, and
    readers would think the rank still stopped (or still watched)."""
    first, second = _framing([1000.0, 1001.0]), _framing([2000.0, 2001.0])
    ids = []
    for framing in (first, second):
        for type_ in ("start", "stop"):
            out = framing.record(type_, seq=41, reason="resumed" if type_ == "start" else None).messages[0]
            assert out.headers["Kvb-Seq"] == "41"
            ids.append(out.headers["Nats-Msg-Id"])
    assert ids == ["w:0:9:t1000000:worker:start", "w:0:9:t1001000:worker:stop",
                   "w:0:9:t2000000:worker:start", "w:0:9:t2001000:worker:stop"]
    # the same fact from either process keeps one name: a gap, a restart
    gaps = [f.record("gap", gap=(3, 4), reason="lost").messages[0].headers["Nats-Msg-Id"]
            for f in (_framing([5.0]), _framing([6.0]))]
    assert gaps == ["w:0:9:3-4:worker:gap"] * 2


def test_payloads_are_each_message_alone_whatever_came_before() -> None:
    """Group payloads go through one kept buffer: a small message after a big
    one carries none of its bytes, and a buffer past the bound is let go."""
    book = SubjectBook("kv", "w", 0)
    for fmt, codec in (("msgpack", msgspec.msgpack), ("json", msgspec.json)):
        enc = MessageEncoder(fmt)
        big = _group("mamba", "state", 1)
        big.events = [BlockRemoved([b"x" * 32] * 64, "GPU", 2)] * (KEPT_BUFFER_BYTES // 2000)
        for msg in (_group("mamba", "state", 0), big, _group("mamba", "state", 2), big):
            out = enc.group(msg, book, "w:0:9")
            assert type(out.payload) is bytes and out.payload == codec.encode(msg)
        assert len(enc._buffer) == 0  # the last one was past the bound: not kept


def test_a_batch_carries_its_structs_only_while_the_keeper_takes_them() -> None:
    """The snapshot keeper applies the struct a payload encodes instead of
    decoding it again; the sink hands them over only while it asks (asked
    once a batch), and a payload alone otherwise."""
    takes = [True]
    ident = StreamIdentity("w", 0, "kv@w", 9)
    framing = Framing(0, ident, SubjectBook("kv", "w", 0), MessageEncoder("msgpack"), lambda: 1 << 20, Metrics(),
                      structlog.get_logger("test"), lambda: 1000.0, keep_bodies=lambda: takes[0])
    cleared = WorkerRecord(v=1, worker="w", dp_rank=0, epoch=9, type="cleared", ts=1.0, seq=5)
    items: list[GroupMessage | WorkerRecord] = [_group("full_attention", "attention", 5), cleared,
                                                _group("full_attention", "attention", 5, part=1)]
    kept, _ = framing.batch(5, 1.0, items)
    assert [m.body for m in kept.messages] == items
    takes[0] = False
    plain, _ = framing.batch(6, 1.0, items)
    assert [m.body for m in plain.messages] == [None, None, None]
    assert [m.payload for m in plain.messages] == [m.payload for m in kept.messages]
    assert framing.record("stop", seq=6).messages[0].body is None
    takes[0] = True
    assert framing.record("stop", seq=6).messages[0].body is not None
