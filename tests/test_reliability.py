"""Gaps healed by replay, losses announced, publisher restarts, malformed frames."""

from __future__ import annotations

import time

import anyio
import msgspec
import pytest

from bridge.embedded.nats_server import NatsServerProcess
from bridge.embedded.publisher import WirePublisher
from bridge.embedded.wire_writer import encode_batch, stored
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
    # every good batch and the good event inside the damaged batch arrive; nothing is a gap
    assert bus.seqs() == [0, 1, 3, 4]
    mixed = [g for g in bus.groups() if g.seq == 3][0]
    assert mixed.events[0].block_hashes == [b"g" * 32]
    assert bus.records("gap") == []


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
