"""The JetStream ack window: PubAcks matched by reply token, refusals and
overdue messages handed back for another publish."""

from __future__ import annotations

import anyio
import pytest

from bridge.producer.sink.ack_errors import NoLeader, NoResponders, NotAPubAck, StreamRefused, ack_error
from bridge.producer.sink.acks import AckWindow, Settled, Trouble, ack_seq, take_acks
from bridge.producer.sink.encode import Outgoing
from bridge.producer.sink.nats_fastpath import BridgeClient
from bridge.producer.sink.queue import OutBatch
from bridge.producer.sink.reorder import reordered_runs

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
    assert isinstance(refused, StreamRefused) and "maximum messages exceeded" in str(refused)
    assert refused.err_code == 10077 and refused.counts
    status = ack_error(b"", b"NATS/1.0 503\r\n\r\n")
    assert isinstance(status, NoResponders) and str(status) == "status 503"
    garbage = ack_error(b"garbage", None)
    assert isinstance(garbage, NotAPubAck) and str(garbage) == "not a PubAck"
    leaderless = ack_error(b'{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}',
                           None)
    assert isinstance(leaderless, NoLeader) and not leaderless.counts


def _batch(seq: int, stream: int = 0) -> OutBatch:
    return OutBatch(stream=stream, epoch=7, seq=seq, vllm_ts=0.0, messages=[])


def _pub(token: int, seq: int, duplicate: bool = False) -> tuple[bytes, bytes, None]:
    dup = b',"duplicate":true' if duplicate else b""
    return b"_I.%d" % token, b'{"stream":"S","seq":%d%s}' % (seq, dup), None


def test_ack_seq_reads_the_stream_sequence() -> None:
    assert ack_seq(b'{"stream":"KV_EVENTS","seq":12}') == 12
    assert ack_seq(b'{"stream":"KV_EVENTS","domain":"d","seq":70123,"duplicate":true}') == 70123
    assert ack_seq(b'{"stream":"KV_EVENTS"}') == -1


def test_acks_settle_by_token_in_any_order_and_an_error_reply_keeps_the_message() -> None:
    win = AckWindow("_INBOX.abc")
    batch = OutBatch(stream=0, epoch=7, seq=41, vllm_ts=0.0, messages=[_msg(0)])
    replies = [win.reply_to(_msg(i), generation=0, now=0.0, origin=batch if i == 0 else None) for i in range(4)]
    assert replies == [f"_INBOX.abc.{i}" for i in range(4)] and len(win) == 4
    win.on_ack(b"_INBOX.abc.0", b'{"error":{"code":500,"description":"boom"}}', None)
    assert win.trouble is Trouble.REFUSED and len(win) == 4
    head = win.head()
    assert head is not None and head[0] == 0 and "boom" in str(head[1].error) and head[1].origin is batch
    win.on_ack(b"_INBOX.abc.2", b'{"stream":"S","seq":1}', None)
    win.on_ack(b"_INBOX.abc.0", b'{"stream":"S","seq":2}', None)  # a later copy's ack settles it
    win.on_ack(b"_INBOX.abc.0", b'{"stream":"S","seq":2}', None)  # a late duplicate ack: ignored
    win.on_ack(b"_INBOX.abc.junk", b'{"stream":"S","seq":3}', None)
    assert len(win) == 2 and [t for t, _ in win.unsettled()] == [1, 3]


def test_in_order_acks_raise_no_trouble_and_keep_no_records() -> None:
    win = AckWindow("_I")
    for i in range(100):
        win.reply_to(_msg(i), 0, 0.0, _batch(i))
    for i in range(100):
        win.on_ack(*_pub(i, 1000 + i))
    assert win.trouble is None and not win.reordered and not win._ahead and not win._resent  # noqa: SLF001
    assert win.head() is None and len(win) == 0


def test_an_ack_that_overtakes_an_older_unacked_one_is_trouble() -> None:
    win = AckWindow("_I")
    for i in range(3):
        win.reply_to(_msg(i), 0, 0.0, _batch(i))
    win.on_ack(*_pub(1, 10))
    assert win.trouble is Trouble.OVERTAKEN


def test_a_copy_sent_again_keeps_its_token_and_place() -> None:
    win = AckWindow("_I")
    for i in range(3):
        win.reply_to(_msg(i), 0, 0.0, _batch(i))
    before = win.wire
    messages, replies = win.resend([0, 2], generation=1, now=5.0)
    assert [m.subject for m in messages] == ["kv.w.0", "kv.w.2"] and replies == ["_I.0", "_I.2"]
    assert [t for t, _ in win.unsettled()] == [0, 1, 2]
    head = win.head()
    assert head is not None and head[1].wire == before and head[1].generation == 1 and head[1].resends == 1
    # the original of 1 acked after the copy of 0 went out: not evidence of a loss
    win.on_ack(*_pub(1, 10))
    assert win.trouble is None


def test_a_lost_message_stored_again_after_newer_ones_is_reordered() -> None:
    """A leader change: 0 and 1 lost, 2 and 3 stored by the new leader, then
    0 and 1 sent again and stored behind them. Both are named; 2 and 3 are not."""
    win = AckWindow("_I")
    batches = [_batch(i) for i in range(4)]
    for i in range(4):
        win.reply_to(_msg(i), 0, 0.0, batches[i])
    win.on_ack(*_pub(2, 100))
    win.on_ack(*_pub(3, 101))
    assert win.trouble is Trouble.OVERTAKEN
    win.resend([0, 1], 0, 1.0)
    win.on_ack(*_pub(0, 102))
    win.on_ack(*_pub(1, 103))
    assert [b.seq for b in win.take_reordered()] == [0, 1]
    assert len(win) == 0 and not win._ahead and not win._resent  # noqa: SLF001


def test_copies_sent_again_that_were_stored_in_order_are_not_reordered() -> None:
    """The acks were lost, not the messages: the copies' acks are duplicates
    naming the first copies' places, which are in order."""
    win = AckWindow("_I")
    for i in range(3):
        win.reply_to(_msg(i), 0, 0.0, _batch(i))
    win.resend([0, 1, 2], 1, 1.0)
    for i in range(3):
        win.on_ack(*_pub(i, 50 + i, duplicate=True))
    assert win.take_reordered() == []


def test_a_newer_message_acked_late_still_reveals_the_older_one_stored_after_it() -> None:
    """1 was stored first but its ack was lost; 0, sent again, is stored after
    it and acked; 1's copy is acked last, as a duplicate naming its earlier
    place. 0 is the late one."""
    win = AckWindow("_I")
    for i in range(2):
        win.reply_to(_msg(i), 0, 0.0, _batch(i))
    win.resend([0, 1], 1, 1.0)
    win.on_ack(*_pub(0, 20))
    assert win.take_reordered() == []
    win.on_ack(*_pub(1, 19, duplicate=True))
    assert [b.seq for b in win.take_reordered()] == [0]


def test_reordering_is_judged_per_worker_and_rank() -> None:
    win = AckWindow("_I")
    win.reply_to(_msg(0), 0, 0.0, _batch(0, stream=0))
    win.reply_to(_msg(1), 0, 0.0, _batch(0, stream=1))
    win.on_ack(*_pub(1, 10))  # rank 1's batch overtakes rank 0's
    win.resend([0], 0, 1.0)
    win.on_ack(*_pub(0, 11))
    assert win.take_reordered() == []


def test_a_late_record_names_the_batches_that_overtook_it() -> None:
    win = AckWindow("_I")
    win.reply_to(_msg(0), 0, 0.0, OutBatch(stream=0, epoch=7, seq=-1, vllm_ts=0.0, messages=[]))
    win.reply_to(_msg(1), 0, 0.0, _batch(5))
    win.on_ack(*_pub(1, 10))
    win.resend([0], 0, 1.0)
    win.on_ack(*_pub(0, 11))
    assert [b.seq for b in win.take_reordered()] == [5]


@pytest.mark.anyio
async def test_wait_settled_tells_stored_refused_and_silent_apart() -> None:
    win = AckWindow("_I")
    for i in range(3):
        win.reply_to(_msg(i), 0, 0.0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_acks_after, win, 0.02, [0])
        assert await win.wait_settled(0, 5.0) is Settled.STORED
    win.on_ack(b"_I.1", b'{"error":{"code":503,"err_code":10008,"description":"x"}}', None)
    assert await win.wait_settled(1, 5.0) is Settled.REFUSED
    assert await win.wait_settled(2, 0.05) is Settled.TIMEOUT


def test_give_up_takes_a_message_out_for_good() -> None:
    win = AckWindow("_I")
    for i in range(3):
        win.reply_to(Outgoing(f"kv.w.{i % 2}", b"x", {}, "attention", 1), 0, 0.0)
    assert win.first_with_subject("kv.w.1") == 1
    entry = win.give_up(1)
    assert entry is not None and entry.msg.subject == "kv.w.1"
    assert [t for t, _ in win.unsettled()] == [0, 2] and win.first_with_subject("kv.w.1") is None


def test_forget_since_drops_a_write_that_never_left() -> None:
    win = AckWindow("_I")
    win.reply_to(_msg(0), 0, 0.0)
    first = win.reply_to(_msg(1), 0, 0.0)
    win.reply_to(_msg(2), 0, 0.0)
    win.forget_since(first)
    assert len(win) == 1
    win.on_ack(b"_I.0", b'{"stream":"S","seq":1}', None)
    assert len(win) == 0 and win.trouble is None


def test_the_window_counts_its_bytes_and_waits_for_room_by_bytes() -> None:
    def big(i: int) -> Outgoing:
        return Outgoing(f"kv.w.{i}", b"p" * 1000, {}, "attention", 1, head=b"h" * 24)

    win = AckWindow("_I")
    replies = [win.reply_to(big(i), 0, float(i)) for i in range(4)]
    assert win.bytes == 4 * 1024
    win.on_ack(b"_I.0", b'{"stream":"S","seq":1}', None)
    win.on_ack(b"_I.1", b'{"error":{"code":500,"description":"boom"}}', None)
    assert win.bytes == 3 * 1024  # a refused one is still in the window: it goes again or is given up
    win.give_up(1)
    assert win.bytes == 2 * 1024
    for i in range(4, 7):
        last = win.reply_to(big(i), 0, 20.0)
    win.forget_since(last)
    assert win.bytes == 4 * 1024 and replies[0] == "_I.0"


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
        nc.on_ack = lambda subject, _payload, _h, got=got: got.append(subject)
        await nc._ps.parse(stream[:cut])  # noqa: SLF001
        await nc._ps.parse(stream[cut:])  # noqa: SLF001
        assert got == [b"_INBOX.abc.%d" % i for i in range(5)], cut


def _stored_order(win: AckWindow) -> list[str]:
    seen: list[str] = []
    win._on_stored = lambda msg, ack: seen.append(msg.headers["Nats-Msg-Id"])  # noqa: SLF001
    return seen


def test_stored_messages_are_handed_over_in_stream_order_at_once_when_acks_come_in_order() -> None:
    win = AckWindow("_I")
    seen = _stored_order(win)
    for i in range(3):
        win.reply_to(_msg(i), 0, 0.0, _batch(i))
        win.on_ack(*_pub(i, 10 + i))
        assert seen == [str(j) for j in range(i + 1)]  # nothing held back


def test_a_lost_acks_copy_is_handed_over_in_its_stream_place() -> None:
    """0 is stored first but its ack is lost; 1 and 2 are acked; 0 is sent
    again and acked as a duplicate of its first place. A reader of the stream
    met 0 first, and so must the bridge's residency (bridge.producer.snapshot.keeper):
    handed over in ack order, 0 would land after 1 and 2 (and be dropped as a
    copy where 1 or 2 is of its group)."""
    win = AckWindow("_I")
    seen = _stored_order(win)
    for i in range(3):
        win.reply_to(_msg(i), 0, 0.0, _batch(i))
    win.on_ack(*_pub(1, 11))
    win.on_ack(*_pub(2, 12))
    assert win.trouble is Trouble.OVERTAKEN and seen == []  # held: something older may be stored before them
    win.resend([0], 1, 1.0)
    win.on_ack(*_pub(0, 10, duplicate=True))
    assert seen == ["0", "1", "2"]
    win.reply_to(_msg(3), 1, 2.0, _batch(3))
    win.on_ack(*_pub(3, 13))
    assert seen == ["0", "1", "2", "3"]


def test_a_copy_stored_behind_newer_messages_is_handed_over_behind_them() -> None:
    """1 was stored first (its ack lost), 0's copy after it: stream order is 1, 0."""
    win = AckWindow("_I")
    seen = _stored_order(win)
    for i in range(2):
        win.reply_to(_msg(i), 0, 0.0, _batch(i))
    win.resend([0, 1], 1, 1.0)
    win.on_ack(*_pub(0, 20))
    assert seen == []  # 1's copy is still in doubt
    win.on_ack(*_pub(1, 19, duplicate=True))
    assert seen == ["1", "0"]


def test_held_messages_go_when_the_older_one_is_given_up() -> None:
    win = AckWindow("_I")
    seen = _stored_order(win)
    for i in range(3):
        win.reply_to(_msg(i), 0, 0.0, _batch(i))
    win.on_ack(*_pub(1, 11))
    win.on_ack(*_pub(2, 12))
    assert seen == []
    win.give_up(0)  # refused for good: never stored
    assert seen == ["1", "2"]


def test_reordered_batches_coalesce_into_runs_per_rank_and_epoch() -> None:
    batches = [_batch(s) for s in (7, 5, 6, 6, 9)] + [_batch(3, stream=1)]
    assert [(r.stream, r.epoch, r.first, r.last) for r in reordered_runs(batches)] == [
        (0, 7, 5, 7), (0, 7, 9, 9), (1, 7, 3, 3),
    ]


def test_core_mode_names_only_what_no_answered_ping_covers() -> None:
    from bridge.producer.sink.confirm import Unconfirmed

    written = Unconfirmed()
    written.note([_batch(s) for s in (0, 1, 2)])
    mark = written.mark()
    written.note([_batch(s) for s in (3, 4)] + [_batch(9, stream=1)])
    written.confirm(mark)  # the PING after 0..2 was answered
    later = written.mark()
    written.note([_batch(5)])
    assert [(r.stream, r.first, r.last) for r in written.take()] == [(0, 3, 5), (1, 9, 9)]
    written.confirm(later)  # a late answer for what was already taken: nothing changes
    assert written.take() == []


def test_healthz_fails_once_nats_is_unusable_past_the_bound() -> None:
    from bridge.producer.telemetry.health import Health

    health = Health(nats_unhealthy_after_s=0.05)
    health.nats_connected = True
    assert health.live()
    health.nats_connected = False
    assert health.live()  # not yet past the bound
    assert health.nats_down_since is not None
    health.nats_down_since -= 0.06  # as if it had been down that long
    assert not health.live() and health.nats_down_for() >= 0.05
    health.nats_connected = True
    assert health.live() and health.nats_down_for() == 0.0
    assert Health(nats_unhealthy_after_s=0.0).live()  # 0: never
