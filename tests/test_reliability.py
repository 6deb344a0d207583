"""Gaps healed by replay, losses announced, publisher restarts, malformed frames."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import anyio
import msgspec
import pytest
import zmq

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.wire_writer import encode_batch, removed, stored
from bridge.contract import GroupMessage
from bridge.producer.normalize.normalizer import MAX_MESSAGES_PER_BATCH
from bridge.producer.source.frames import END_SEQ_FRAME, socket_limit
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import BusCollector, endpoints, make_settings, metric, running_bridge

pytestmark = pytest.mark.anyio


def batch(i: int, group: int = 0) -> bytes:
    kind = "full_attention" if group == 0 else "mamba"
    return encode_batch(time.time(), [stored([i.to_bytes(32, "big")], None, [i], 16, group_idx=group, kind=kind)])


async def _bridge_and_bus(nats_server: NatsServerProcess, pub_ep: str, replay_ep: str | None, **kw: object):
    # Idle probes off unless a test wants them: these tests count replays exactly.
    kw.setdefault("idle_probe_interval", "0")
    settings = make_settings(
        zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep] if replay_ep else None, nats_url=[nats_server.url], **kw
    )
    bus = await BusCollector().start(nats_server.url)
    return settings, bus


async def test_dropped_batches_are_healed_by_replay(nats_server: NatsServerProcess) -> None:
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep)
    try:
        async with running_bridge(settings) as bridge:
            for i in range(30):
                # batches 5, 6 and 20 never reach the subscriber live
                pub.publish(batch(i), drop=i in (5, 6, 20))
            await bus.wait_for(lambda b: len(b.seqs()) >= 30)
            await anyio.sleep(0.3)
            assert metric(bridge, "kvbridge_replays_total", result="complete") == 2
            assert metric(bridge, "kvbridge_replayed_batches_total") == 3
            assert metric(bridge, "kvbridge_dropped_total", reason="duplicate") == 0
    finally:
        pub.close()
        await bus.close()
    assert bus.seqs() == list(range(30))
    assert bus.records("gap") == []
    # payload follows seq: each batch carries its own hash
    for g in bus.groups():
        assert g.events[0].block_hashes == [g.seq.to_bytes(32, "big")]


async def test_what_replay_no_longer_holds_is_announced_as_a_gap(nats_server: NatsServerProcess) -> None:
    pub_ep, replay_ep = endpoints()
    # a replay buffer of 3 batches: a burst of 6 lost batches cannot all come back
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"), buffer_steps=3)
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep)
    try:
        async with running_bridge(settings) as bridge:
            pub.publish(batch(0))
            await bus.wait_for(lambda b: b.seqs() == [0])
            for i in range(1, 7):
                pub.publish(batch(i), drop=True)
            pub.publish(batch(7))
            await bus.wait_for(lambda b: 7 in b.seqs())
            assert metric(bridge, "kvbridge_gap_batches_total") == 4
    finally:
        pub.close()
        await bus.close()
    # seqs 1..4 fell out of the 3-batch buffer by the time 7 came; 5 and 6 were replayed
    assert bus.seqs() == [0, 5, 6, 7]
    gaps = bus.records("gap")
    assert [(g.gap_from, g.gap_to, g.reason) for g in gaps] == [(1, 4, "replay_incomplete")]
    # the gap record precedes the batches after it
    kinds = [(r.body.type if r.subject.endswith(".worker") else r.body.seq) for r in bus.items]
    assert kinds.index("gap") < kinds.index(5)


async def test_without_replay_endpoint_a_gap_is_announced(nats_server: NatsServerProcess) -> None:
    pub_ep, _ = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), None)
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, None)
    try:
        async with running_bridge(settings):
            pub.publish(batch(0))
            await bus.wait_for(lambda b: b.seqs() == [0])
            pub.publish(batch(1), drop=True)
            pub.publish(batch(2))
            await bus.wait_for(lambda b: 2 in b.seqs())
    finally:
        pub.close()
        await bus.close()
    assert [(g.gap_from, g.gap_to, g.reason) for g in bus.records("gap")] == [(1, 1, "no_replay_endpoint")]


async def test_publisher_restart_starts_a_new_epoch(nats_server: NatsServerProcess) -> None:
    vllm = pytest.importorskip("vllm.distributed.kv_events")
    pub_ep, replay_ep = endpoints()
    port, rport = pub_ep.rsplit(":", 1)[1], replay_ep.rsplit(":", 1)[1]

    def vllm_batch(i: int, kind: str) -> object:
        return vllm.KVEventBatch(ts=time.time(), events=[vllm.BlockStored(
            block_hashes=[i.to_bytes(32, "big")], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
            medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind=kind)])

    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep)
    try:
        async with running_bridge(settings) as bridge:
            first = vllm.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
            await anyio.sleep(0.5)  # let the SUB connect: PUB drops what it sends before
            for i in range(5):
                first.publish(vllm_batch(i, "mamba"))
            await bus.wait_for(lambda b: len(b.groups()) == 5)
            first.shutdown()
            await anyio.sleep(0.3)
            second = vllm.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
            # the new process reuses group 1 for another kind: learned kinds must be forgotten
            await anyio.sleep(0.5)
            for i in range(3):
                second.publish(vllm_batch(100 + i, "sliding_window"))
            await bus.wait_for(lambda b: len(b.groups()) == 8)
            second.shutdown()
            assert metric(bridge, "kvbridge_restarts_total") == 1
    finally:
        await bus.close()
    groups = bus.groups()
    assert [g.seq for g in groups] == [0, 1, 2, 3, 4, 0, 1, 2]
    old, new = groups[0].epoch, groups[5].epoch
    assert new > old and all(g.epoch == old for g in groups[:5]) and all(g.epoch == new for g in groups[5:])
    assert [g.family for g in groups] == ["state"] * 5 + ["window"] * 3
    restart = bus.records("restart")
    assert len(restart) == 1 and restart[0].epoch == new
    # Msg-Ids of the two processes never collide although their seqs do
    ids = [r.headers["Nats-Msg-Id"] for r in bus.items]
    assert len(ids) == len(set(ids))


async def test_malformed_frames_among_good_traffic(nats_server: NatsServerProcess) -> None:
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep, max_frame_bytes="4096")
    enc = msgspec.msgpack.Encoder().encode
    good_event = stored([b"g" * 32], None, [1], 16, group_idx=0, kind="full_attention")
    try:
        async with running_bridge(settings) as bridge:
            pub.publish(batch(0))
            pub.send_raw([b"only-one-frame"])
            pub.send_raw([b"", b"\x00\x01", b"short seq"])
            pub.send_raw([b"", (999).to_bytes(8, "big"), b"x" * 5000])  # over --max-frame-bytes
            pub.publish(batch(1))
            pub.publish(b"\xc1 not msgpack")  # numbered: a malformed batch in sequence
            pub.publish(enc([time.time(), [good_event, {"type": "Bogus"}, {"type": "BlockStored", "block_hashes": 5}]]))
            pub.publish(batch(4))
            await bus.wait_for(lambda b: 4 in b.seqs())
            assert metric(bridge, "kvbridge_malformed_total", reason="frame_count") == 1
            assert metric(bridge, "kvbridge_malformed_total", reason="bad_seq") == 1
            assert metric(bridge, "kvbridge_malformed_total", reason="too_large") == 1
            assert metric(bridge, "kvbridge_malformed_total", reason="bad_batch") == 1
            assert metric(bridge, "kvbridge_malformed_total", reason="unknown_event_type") == 1
            assert metric(bridge, "kvbridge_malformed_total", reason="bad_event") == 1
    finally:
        pub.close()
        await bus.close()
    # every good batch and the good event inside the damaged batch arrive
    assert bus.seqs() == [0, 1, 3, 4]
    mixed = [g for g in bus.groups() if g.seq == 3][0]
    assert mixed.events[0].block_hashes == [b"g" * 32]
    # the batch that could not be decoded and the one that lost events are named;
    # frames refused before their seq was believed are not batches
    assert [(g.gap_from, g.gap_to, g.reason) for g in bus.records("gap")] == [(2, 2, "malformed"), (3, 3, "malformed")]
    order = [(r.body.type, r.body.gap_from) if r.subject.endswith(".worker") else r.body.seq for r in bus.items]
    assert order.index(("gap", 2)) < order.index(3) < order.index(("gap", 3)) < order.index(4)


async def test_a_lost_tail_is_healed_while_the_publisher_is_quiet(nats_server: NatsServerProcess) -> None:
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep, idle_probe_interval="0.3")
    try:
        async with running_bridge(settings) as bridge:
            for i in range(5):
                pub.publish(batch(i))
            # the last two batches are lost and nothing follows them
            pub.publish(batch(5), drop=True)
            pub.publish(batch(6), drop=True)
            await bus.wait_for(lambda b: len(b.seqs()) == 7, timeout=10)
            assert metric(bridge, "kvbridge_replays_total", result="probe") >= 1
    finally:
        pub.close()
        await bus.close()
    assert bus.seqs() == list(range(7))
    assert bus.records("gap") == []


def _damaged(kind: int, seq: int) -> tuple[bytes, bool]:
    """A numbered batch the publisher got wrong, and whether it still holds a
    good event (hash `m` + seq, group 0) that must be delivered."""
    enc = msgspec.msgpack.encode
    good = stored([b"m" * 24 + seq.to_bytes(8, "big")], None, [1], 16, group_idx=0, kind="full_attention")
    if kind == 0:
        return b"\xc1" + seq.to_bytes(8, "big"), False  # not msgpack at all
    if kind == 1:
        return encode_batch(time.time(), [good])[:-3], False  # cut short
    if kind == 2:
        return enc([time.time(), [good, {"type": "BlockStored", "block_hashes": "not-a-list"}]]), True
    if kind == 3:
        return enc([time.time(), [{"type": "BlockPromoted"}, good]]), True
    if kind == 4:
        return encode_batch(time.time(), [good, stored([b"x"], None, [], 16, group_idx=5000, kind="mamba")]), True
    # more groups than a batch may yield messages: the tail is cut off
    wide = [stored([b"w" * 32], None, [], 16, group_idx=g, kind="full_attention") for g in range(1, 300)]
    return encode_batch(time.time(), [good, *wide]), True


async def test_every_malformed_batch_is_named_by_a_gap(nats_server: NatsServerProcess) -> None:
    """A hostile run: damaged batches of every kind among good ones. Each
    damaged batch is named by exactly one `malformed` gap, after whatever good
    events it carried; every good batch arrives; nothing else is a gap."""
    rng = random.Random(14)
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep)
    damaged: dict[int, bool] = {}
    good: list[int] = []
    try:
        async with running_bridge(settings) as bridge:
            await anyio.sleep(0.3)  # the SUB is connected: nothing is lost to the slow joiner
            for seq in range(600):
                if rng.random() < 0.5:
                    payload, carries = _damaged(rng.randrange(6), seq)
                    damaged[seq] = carries
                    pub.publish(payload)
                else:
                    good.append(seq)
                    pub.publish(batch(seq))
                if seq % 100 == 99:
                    await anyio.to_thread.run_sync(pub.wait_idle)
            await bus.wait_for(lambda b: len(b.records("gap")) >= len(damaged) and good[-1] in b.seqs(), timeout=30)
            await anyio.sleep(0.3)
            gaps_counted = metric(bridge, "kvbridge_gaps_total", reason="malformed")
    finally:
        pub.close()
        await bus.close()
    gaps = bus.records("gap")
    assert sorted(g.gap_from for g in gaps) == sorted(damaged)
    assert all(g.gap_from == g.gap_to and g.reason == "malformed" for g in gaps)
    assert gaps_counted == len(damaged)
    carried = {seq for seq, has_good in damaged.items() if has_good}
    assert [s for s in bus.seqs() if s not in carried] == good
    first = {g.seq: g for g in reversed(bus.groups()) if g.seq in carried}
    assert sorted(first) == sorted(carried)
    for seq, g in first.items():
        assert g.group == 0 and g.events[0].block_hashes == [b"m" * 24 + seq.to_bytes(8, "big")]
    # a batch yields at most MAX_MESSAGES_PER_BATCH messages, whatever it holds
    per_seq = Counter(g.seq for g in bus.groups())
    assert max(per_seq.values()) == MAX_MESSAGES_PER_BATCH
    # a batch's gap follows its good events
    order = [("gap", r.body.gap_from) if r.subject.endswith(".worker") else ("batch", r.body.seq) for r in bus.items]
    for seq in carried:
        assert order.index(("batch", seq)) < order.index(("gap", seq))


async def test_a_slice_over_max_payload_arrives_in_chunks_that_fit(nats_server: NatsServerProcess) -> None:
    """30 000 removals (about 2.5 MB once encoded) against nats-server's 1 MB
    max_payload: pieces in order, each within the limit, every hash once."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep)
    hashes = [i.to_bytes(32, "big") for i in range(30_000)]
    try:
        async with running_bridge(settings):
            await anyio.sleep(0.3)
            pub.publish(encode_batch(time.time(), [removed([h], group_idx=0) for h in hashes]))
            pub.publish(batch(1))
            await bus.wait_for(lambda b: 1 in b.seqs())
    finally:
        pub.close()
        await bus.close()
    at = [i for i, r in enumerate(bus.items) if isinstance(r.body, GroupMessage) and r.body.seq == 0]
    pieces = [bus.items[i].body for i in at]
    assert len(pieces) > 2
    assert [p.chunk for p in pieces] == list(range(len(pieces))) and {p.chunks for p in pieces} == {len(pieces)}
    assert all(len(bus.raw[i]) <= 1024 * 1024 for i in at)  # nats-server's default max_payload
    assert [h for p in pieces for ev in p.events for h in ev.block_hashes] == hashes
    assert bus.records("gap") == []


class HangingReplay:
    """A PUB and a replay ROUTER like vLLM's, except that an answer stops,
    without its end marker, at any seq in `hang_at`: a replay that cannot
    complete, whatever is asked again."""

    def __init__(self, pub_ep: str, replay_ep: str, hang_at: set[int], garble: bool = False) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # XPUB: sends as PUB does, and shows when the bridge has subscribed
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(pub_ep.replace("127.0.0.1", "*"))
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(replay_ep.replace("127.0.0.1", "*"))
        self._hang_at = hang_at
        # `garble`: the answer sends a malformed frame (a 3-byte seq) where it stops
        self._garble = garble
        self._buffer: list[bytes] = []
        self.asked: list[int] = []
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish(self, payload: bytes, *, drop: bool = False) -> None:
        seq = len(self._buffer)
        self._buffer.append(payload)
        if not drop:
            self._pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def subscribed(self) -> None:
        with anyio.fail_after(10):
            while not self._pub.poll(0):
                await anyio.sleep(0.02)
        self._pub.recv()

    def _serve(self) -> None:
        while self._running:
            if not self._router.poll(20):
                continue
            client, _, start = self._router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.asked.append(first)
            for seq in range(first, len(self._buffer)):
                if seq in self._hang_at:
                    if self._garble:
                        self._router.send_multipart([client, b"", b"", b"bad", self._buffer[seq]])
                    break
                self._router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), self._buffer[seq]])
            else:
                self._router.send_multipart([client, b"", b"", END_SEQ_FRAME, b""])

    def close(self) -> None:
        self._running = False
        self._thread.join(5)
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()


async def test_a_replay_that_never_completes_is_given_up_and_named(nats_server: NatsServerProcess) -> None:
    """Replay stops at seq 5 every time it is asked: after the retries the
    bridge skips 5, takes 6..9 from an answer that starts past it, names 5
    alone, and the live stream goes on (issue 25)."""
    pub_ep, replay_ep = endpoints()
    pub = HangingReplay(pub_ep, replay_ep, hang_at={5})
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep, replay_timeout="0.3", replay_retries="1")
    try:
        async with running_bridge(settings):
            await _until_subscribed(pub, bus)
            for i in range(1, 10):
                pub.publish(batch(i), drop=i >= 5)
            pub.publish(batch(10))
            await bus.wait_for(lambda b: 10 in b.seqs(), timeout=10)
            for i in range(11, 13):
                pub.publish(batch(i))
            await bus.wait_for(lambda b: 12 in b.seqs(), timeout=10)
    finally:
        pub.close()
        await bus.close()
    assert bus.seqs() == [i for i in range(13) if i != 5]
    assert [(g.gap_from, g.gap_to, g.reason) for g in bus.records("gap")] == [(5, 5, "replay_timeout")]
    # two attempts at 5 (one retry), then one past it
    assert pub.asked == [5, 5, 6]


async def test_a_quiet_tail_replay_cannot_return_is_named_once_live_shows_it(nats_server: NatsServerProcess) -> None:
    """Replay never answers past seq 4 and the stream is quiet: an idle probe
    proves nothing lost (no gap, no endless retry); the next live batch shows
    the hole, and it is named within one recovery."""
    pub_ep, replay_ep = endpoints()
    pub = HangingReplay(pub_ep, replay_ep, hang_at=set(range(5, 8)))
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep, replay_timeout="0.3", replay_retries="1",
                                          idle_probe_interval="0.2")
    try:
        async with running_bridge(settings) as bridge:
            await _until_subscribed(pub, bus)
            for i in range(1, 8):
                pub.publish(batch(i), drop=i >= 5)
            await bus.wait_for(lambda b: 4 in b.seqs(), timeout=10)
            with anyio.fail_after(10):
                while metric(bridge, "kvbridge_replays_total", result="timeout") < 2:
                    await anyio.sleep(0.05)
            assert bus.records("gap") == []
            pub.publish(batch(8))
            await bus.wait_for(lambda b: 8 in b.seqs(), timeout=10)
    finally:
        pub.close()
        await bus.close()
    assert bus.seqs() == [0, 1, 2, 3, 4, 8]
    assert [(g.gap_from, g.gap_to, g.reason) for g in bus.records("gap")] == [(5, 7, "replay_timeout")]


async def test_a_malformed_replay_answer_in_a_quiet_tail_is_skipped_and_named(
        nats_server: NatsServerProcess) -> None:
    """Every answer that reaches seq 6 sends a malformed frame there and
    stops: the probe takes 5, asks from 6 again, then skips it, names it,
    and publishes 7 and 8."""
    pub_ep, replay_ep = endpoints()
    pub = HangingReplay(pub_ep, replay_ep, hang_at={6}, garble=True)
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep, replay_timeout="0.3", replay_retries="1",
                                          idle_probe_interval="0.2")
    try:
        async with running_bridge(settings) as bridge:
            await _until_subscribed(pub, bus)
            for i in range(1, 9):
                pub.publish(batch(i), drop=i >= 5)
            await bus.wait_for(lambda b: 8 in b.seqs(), timeout=10)
            assert metric(bridge, "kvbridge_malformed_total", reason="bad_seq") >= 2
    finally:
        pub.close()
        await bus.close()
    assert bus.seqs() == [0, 1, 2, 3, 4, 5, 7, 8]
    assert [(g.gap_from, g.gap_to, g.reason) for g in bus.records("gap")] == [(6, 6, "replay_timeout")]
    # from 6 a bounded number of times (twice a probe; the first probe's
    # bound may end before its second), then past it
    assert 2 <= pub.asked.count(6) <= 4 and pub.asked.index(7) > pub.asked.index(6), pub.asked


async def test_oversize_frames_in_a_quiet_tail_are_skipped_and_named(nats_server: NatsServerProcess) -> None:
    """Two batches past the socket limit among a lost tail: each replay answer
    holding one is cut off by libzmq; the probe skips each, names it, and
    publishes every good batch around them."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    oversize = 2 * socket_limit(1024)
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep, max_frame_bytes="1024",
                                          replay_timeout="5", idle_probe_interval="0.2")
    try:
        async with running_bridge(settings) as bridge:
            for i in range(5):
                pub.publish(batch(i))
            await bus.wait_for(lambda b: 4 in b.seqs(), timeout=10)
            for i in range(5, 10):
                pub.publish(b"\x00" * oversize if i in (5, 7) else batch(i), drop=True)
            await bus.wait_for(lambda b: 9 in b.seqs(), timeout=20)
            # cut off at once, never waiting the 5 s replay timeout out
            assert metric(bridge, "kvbridge_replays_total", result="timeout") >= 2
    finally:
        pub.close()
        await bus.close()
    assert bus.seqs() == [0, 1, 2, 3, 4, 6, 8, 9]
    assert [(g.gap_from, g.gap_to, g.reason) for g in bus.records("gap")] == [(5, 5, "replay_timeout"),
                                                                               (7, 7, "replay_timeout")]


async def _until_subscribed(pub: HangingReplay, bus: BusCollector) -> None:
    """Seq 0 goes out once the SUB has joined, and is published."""
    await pub.subscribed()
    pub.publish(batch(0))
    await bus.wait_for(lambda b: 0 in b.seqs(), timeout=10)


async def test_a_replay_socket_nobody_listens_on_costs_one_attempt(nats_server: NatsServerProcess) -> None:
    """A wrong --replay-endpoint: no connection is ever made, so retrying is
    no use; each gap costs one --replay-timeout and is named."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), None)
    settings, bus = await _bridge_and_bus(nats_server, pub_ep, replay_ep, replay_timeout="0.5", replay_retries="3")
    try:
        async with running_bridge(settings) as bridge:
            pub.publish(batch(0))
            await bus.wait_for(lambda b: 0 in b.seqs(), timeout=10)
            pub.publish(batch(1), drop=True)
            pub.publish(batch(2))
            await bus.wait_for(lambda b: 2 in b.seqs(), timeout=10)
            assert metric(bridge, "kvbridge_replays_total", result="timeout") == 1
    finally:
        pub.close()
        await bus.close()
    assert [(g.gap_from, g.gap_to, g.reason) for g in bus.records("gap")] == [(1, 1, "replay_timeout")]
