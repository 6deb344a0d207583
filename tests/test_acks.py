"""The JetStream ack window: PubAcks matched by reply token, refusals and
overdue messages handed back for another publish."""

from __future__ import annotations

from bridge.sink.acks import AckWindow, ack_error
from bridge.sink.encode import Outgoing


def _msg(i: int) -> Outgoing:
    return Outgoing(f"kv.w.{i}", b"x", {"Nats-Msg-Id": str(i)}, "attention", 1)


def test_ack_error_tells_pubacks_from_refusals() -> None:
    assert ack_error(b'{"stream":"KV_EVENTS","seq":12}', None) is None
    assert ack_error(b'{"stream":"KV_EVENTS","seq":12,"duplicate":true}', None) is None
    refused = ack_error(b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}', None)
    assert refused is not None and "maximum messages exceeded" in refused
    assert ack_error(b"", b"NATS/1.0 503\r\n\r\n") == "status 503"
    assert ack_error(b"garbage", None) == "not a PubAck"


def test_acks_settle_by_token_in_any_order_and_refusals_come_back() -> None:
    win = AckWindow("_INBOX.abc")
    replies = [win.reply_to(_msg(i), generation=0, now=0.0) for i in range(4)]
    assert replies == [f"_INBOX.abc.{i}" for i in range(4)] and len(win) == 4
    win.on_ack(b"_INBOX.abc.2", b'{"stream":"S","seq":1}', None)
    win.on_ack(b"_INBOX.abc.0", b'{"error":{"code":500,"description":"boom"}}', None)
    win.on_ack(b"_INBOX.abc.0", b'{"stream":"S","seq":2}', None)  # a late duplicate ack: ignored
    win.on_ack(b"_INBOX.abc.junk", b'{"stream":"S","seq":3}', None)
    assert len(win) == 2
    assert [(m.subject, "boom" in why) for m, why in win.failed] == [("kv.w.0", True)]


def test_overdue_takes_out_the_late_and_those_of_a_lost_connection_oldest_first() -> None:
    win = AckWindow("_I")
    for i in range(3):
        win.reply_to(_msg(i), generation=0, now=float(i))
    win.reply_to(_msg(3), generation=1, now=3.0)
    assert win.first_generation() == 0 and win.oldest_age(4.0) == 4.0
    # generation 1 is current: everything sent on generation 0 is owed again.
    assert [m.subject for m in win.overdue(now=3.5, timeout=5.0, generation=1)] == ["kv.w.0", "kv.w.1", "kv.w.2"]
    assert win.overdue(now=3.5, timeout=5.0, generation=1) == []
    assert [m.subject for m in win.overdue(now=9.0, timeout=5.0, generation=1)] == ["kv.w.3"]
    assert len(win) == 0


def test_forget_since_drops_a_write_that_never_left() -> None:
    win = AckWindow("_I")
    win.reply_to(_msg(0), 0, 0.0)
    first = win.reply_to(_msg(1), 0, 0.0)
    win.reply_to(_msg(2), 0, 0.0)
    win.forget_since(first)
    assert len(win) == 1
    win.on_ack(b"_I.0", b'{"stream":"S","seq":1}', None)
    assert len(win) == 0 and not win.failed
