"""The JetStream ack window: PubAcks matched by reply token, refusals and
overdue messages handed back for another publish."""

from __future__ import annotations

import anyio
import pytest

from bridge.sink.acks import AckWindow, ack_error, take_acks
from bridge.sink.encode import Outgoing
from bridge.sink.nats_fastpath import BridgeClient
from bridge.sink.queue import OutBatch

PREFIX = b"MSG _INBOX.abc."


def _ack(token: int, seq: int) -> bytes:
    payload = b'{"stream":"KV_EVENTS","seq":%d}' % seq
    return b"MSG _INBOX.abc.%d 7 %d\r\n%s\r\n" % (token, len(payload), payload)


def _msg(i: int) -> Outgoing:
    return Outgoing(f"kv.w.{i}", b"x", {"Nats-Msg-Id": str(i)}, "attention", 1)


def test_ack_error_tells_pubacks_from_refusals() -> None:
    assert ack_error(b'{"stream":"KV_EVENTS","seq":12}', None) is None
    assert ack_error(b'{"stream":"KV_EVENTS","seq":12,"duplicate":true}', None) is None
    refused = ack_error(b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}', None)
    assert refused is not None and "maximum messages exceeded" in refused
    assert ack_error(b"", b"NATS/1.0 503\r\n\r\n") == "status 503"
    assert ack_error(b"garbage", None) == "not a PubAck"


def test_acks_settle_by_token_in_any_order_and_refusals_come_back_with_their_batch() -> None:
    win = AckWindow("_INBOX.abc")
    batch = OutBatch(stream=0, epoch=7, seq=41, vllm_ts=0.0, messages=[_msg(0)])
    replies = [win.reply_to(_msg(i), generation=0, now=0.0, origin=batch if i == 0 else None) for i in range(4)]
    assert replies == [f"_INBOX.abc.{i}" for i in range(4)] and len(win) == 4
    win.on_ack(b"_INBOX.abc.2", b'{"stream":"S","seq":1}', None)
    win.on_ack(b"_INBOX.abc.0", b'{"error":{"code":500,"description":"boom"}}', None)
    win.on_ack(b"_INBOX.abc.0", b'{"stream":"S","seq":2}', None)  # a late duplicate ack: ignored
    win.on_ack(b"_INBOX.abc.junk", b'{"stream":"S","seq":3}', None)
    assert len(win) == 2
    assert [(m.subject, b, "boom" in why) for m, b, why in win.failed] == [("kv.w.0", batch, True)]


def test_overdue_takes_out_the_late_and_those_of_a_lost_connection_oldest_first() -> None:
    win = AckWindow("_I")
    for i in range(3):
        win.reply_to(_msg(i), generation=0, now=float(i))
    win.reply_to(_msg(3), generation=1, now=3.0)
    assert win.first_generation() == 0 and win.oldest_age(4.0) == 4.0
    # generation 1 is current: everything sent on generation 0 is owed again.
    assert [m.subject for m, _ in win.overdue(now=3.5, timeout=5.0, generation=1)] == ["kv.w.0", "kv.w.1", "kv.w.2"]
    assert win.overdue(now=3.5, timeout=5.0, generation=1) == []
    assert [m.subject for m, _ in win.overdue(now=9.0, timeout=5.0, generation=1)] == ["kv.w.3"]
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


def test_the_window_counts_its_bytes_and_waits_for_room_by_bytes() -> None:
    def big(i: int) -> Outgoing:
        return Outgoing(f"kv.w.{i}", b"p" * 1000, {}, "attention", 1, head=b"h" * 24)

    win = AckWindow("_I")
    replies = [win.reply_to(big(i), 0, float(i)) for i in range(4)]
    assert win.bytes == 4 * 1024
    win.on_ack(b"_I.0", b'{"stream":"S","seq":1}', None)
    win.on_ack(b"_I.1", b'{"error":{"code":500,"description":"boom"}}', None)
    assert win.bytes == 2 * 1024  # a refused one is no longer in flight: it waits in `failed`
    assert [m.subject for m, _ in win.overdue(now=10.0, timeout=5.0, generation=0)] == ["kv.w.2", "kv.w.3"]
    assert win.bytes == 0
    for i in range(4, 7):
        last = win.reply_to(big(i), 0, 20.0)
    win.forget_since(last)
    assert win.bytes == 2 * 1024 and replies[0] == "_I.0"


async def _acks_after(win: AckWindow, delay: float, tokens: list[int]) -> None:
    await anyio.sleep(delay)
    for t in tokens:
        win.on_ack(f"_I.{t}".encode(), b'{"stream":"S","seq":1}', None)


def test_wait_below_returns_only_when_bytes_are_low_enough() -> None:
    async def main() -> tuple[int, int]:
        win = AckWindow("_I")
        for i in range(4):
            win.reply_to(Outgoing(f"kv.w.{i}", b"p" * 1000, {}, "attention", 1), 0, 0.0)
        async with anyio.create_task_group() as tg:
            # Four in flight, 4000 bytes: a count bound of 10 alone would not wait.
            tg.start_soon(_acks_after, win, 0.05, [0, 1])
            await win.wait_below(10, 30.0, low_bytes=2000)
        return len(win), win.bytes

    assert anyio.run(main) == (2, 2000)


def test_take_acks_hands_over_whole_ack_frames_and_stops_at_anything_else() -> None:
    got: list[tuple[bytes, bytes]] = []
    data = _ack(0, 10) + _ack(1, 11) + b"PING\r\n" + _ack(2, 12)
    used = take_acks(data, PREFIX, lambda subject, payload, _h: got.append((subject, payload)))
    assert data[used:].startswith(b"PING\r\n")
    assert got == [(b"_INBOX.abc.0", b'{"stream":"KV_EVENTS","seq":10}'),
                   (b"_INBOX.abc.1", b'{"stream":"KV_EVENTS","seq":11}')]
    # cut by the read (in the control line or the payload): left for nats-py's parser
    whole = _ack(3, 13)
    for cut in range(1, len(whole)):
        assert take_acks(_ack(4, 14) + whole[:cut], PREFIX, lambda *_: None) == len(_ack(4, 14))
    # another subscription's message, or one with a reply subject: not an ack
    assert take_acks(b"MSG _INBOX.other.1 9 2\r\n{}\r\n", PREFIX, lambda *_: None) == 0
    assert take_acks(b"MSG _INBOX.abc.1 7 _R.x 2\r\n{}\r\n", PREFIX, lambda *_: None) == 0


@pytest.mark.anyio
async def test_acks_arrive_once_in_order_however_the_reads_cut_the_stream() -> None:
    """Acks around other protocol lines, split into two reads at every byte:
    the shortcut and nats-py's parser between them hand every ack over once, in order."""
    stream = (_ack(0, 1) + _ack(1, 2) + b"+OK\r\n" + _ack(2, 3)
              + b"MSG kv.other 9 2\r\n{}\r\n" + _ack(3, 4) + _ack(4, 5))
    for cut in range(len(stream) + 1):
        nc = BridgeClient()
        got: list[bytes] = []
        nc.ack_sid = 7
        nc.ack_prefix = PREFIX
        nc.on_ack = lambda subject, _payload, _h, got=got: got.append(subject)  # type: ignore[misc]
        await nc._ps.parse(stream[:cut])  # noqa: SLF001
        await nc._ps.parse(stream[cut:])  # noqa: SLF001
        assert got == [b"_INBOX.abc.%d" % i for i in range(5)], cut
