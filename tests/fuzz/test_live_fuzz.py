"""Random and mutated frames through a live bridge (real ZMQ, real nats-server),
mixed with good batches: the bridge never crashes, never stalls, every good
batch arrives once, and `kvbridge_malformed_total{reason}` counts the junk."""

from __future__ import annotations

import hashlib
import os
import random
import time
from typing import cast

import anyio
import msgspec
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.producer.decode.decoder import BatchDecodeError, BatchDecoder
from bridge.producer.normalize.normalizer import KindBook, Normalizer, NormalizeStats, StreamIdentity
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import BusCollector, endpoints, make_settings, metric, running_bridge
from tests.fuzz.live import good_arrivals, good_batch, template_batch, wait_good

pytestmark = pytest.mark.anyio

MAX_FRAME = 64 * 1024
SEED = int(os.environ.get("KVB_FUZZ_SEED", "4242"))
ROUNDS = int(os.environ.get("KVB_FUZZ_LIVE_ROUNDS", "300"))


def _bind(ep: str) -> str:
    return ep.replace("127.0.0.1", "*")


def _flip_bits(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _raw_junk(rng: random.Random) -> tuple[str, list[bytes]]:
    """A multipart message no frame check may let through: (reason, frames)."""
    seq = rng.randrange(2**64).to_bytes(8, "big")
    payload = rng.randbytes(rng.randint(0, 64))
    choice = rng.randrange(4)
    if choice == 0:
        n = rng.choice([1, 2, 4, 5, 7])
        return "frame_count", [rng.randbytes(rng.randint(0, 16)) for _ in range(n)]
    if choice == 1:
        bad_len = rng.choice([0, 1, 4, 7, 9, 16])
        return "bad_seq", [b"", rng.randbytes(bad_len), payload]
    if choice == 2:
        return "too_large", [b"", seq, rng.randbytes(MAX_FRAME + rng.randint(1, 4096))]
    return "bad_topic", [rng.randbytes(rng.randint(1025, 2048)), seq, payload]


def _payload_junk(rng: random.Random, j: int) -> bytes:
    """A numbered batch whose payload is damaged: bit flips, truncation, garbage."""
    base = template_batch(j)
    choice = rng.randrange(6)
    if choice == 0:
        return _flip_bits(base, rng)
    if choice == 1:
        return base[: rng.randrange(len(base))]
    if choice == 2:
        return base + rng.randbytes(rng.randint(1, 16))
    if choice == 3:
        return rng.randbytes(rng.randint(0, 256))
    if choice == 4:
        # a valid msgpack value of the wrong shape
        return msgspec.msgpack.encode(rng.choice([{"ts": 1}, [], [None], ["ts", []], 42, "batch", [1.0, {}]]))
    # splice: a good batch's head on another's tail
    other = template_batch(j + 1)
    cut = rng.randrange(1, len(base))
    return base[:cut] + other[cut:]


def _malformed(payload: bytes) -> bool:
    """Whether the bridge (msgpack output) refuses the batch or any event of it."""
    try:
        batch = BatchDecoder(relay=True).decode(payload)
    except BatchDecodeError:
        return True
    stats = NormalizeStats()
    Normalizer(KindBook({}), False).normalize(StreamIdentity("w", 0, "", 1), 0, batch.ts, batch.events, 0.0, stats)
    return bool(batch.rejected or stats.malformed)


async def test_hostile_frames_among_good_batches(nats_server: NatsServerProcess) -> None:
    rng = random.Random(SEED)
    print(f"\nlive fuzz seed: KVB_FUZZ_SEED={SEED}")
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             max_frame_bytes=str(MAX_FRAME))
    bus = await BusCollector().start(nats_server.url)
    raw_sent: dict[str, int] = {}
    numbered_junk = 0
    seq_of_good: dict[int, int] = {}
    malformed_seqs: set[int] = set()
    seq = 0
    try:
        async with running_bridge(settings) as bridge:
            await anyio.sleep(0.3)  # the SUB is connected: nothing is lost to the slow joiner
            for k in range(ROUNDS):
                for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                    if rng.random() < 0.5:
                        reason, frames = _raw_junk(rng)
                        raw_sent[reason] = raw_sent.get(reason, 0) + 1
                        pub.send_raw(frames)
                    else:
                        junk = _payload_junk(rng, k)
                        pub.publish(junk)
                        numbered_junk += 1
                        if _malformed(junk):
                            malformed_seqs.add(seq)
                        seq += 1
                pub.publish(good_batch(k))
                seq_of_good[k] = seq
                seq += 1
                if k % 50 == 0:
                    await anyio.to_thread.run_sync(pub.wait_idle)
            await anyio.to_thread.run_sync(pub.wait_idle)
            # no stall: the last good batch arrives soon after the junk
            elapsed = await wait_good(bus, list(range(ROUNDS)), timeout=15)
            await bus.wait_for(lambda b: len(b.records("gap")) >= len(malformed_seqs))
            counts = {r: metric(bridge, "kvbridge_malformed_total", reason=r)
                      for r in ("frame_count", "bad_seq", "too_large", "bad_topic", "bad_batch", "bad_event",
                                "unknown_event_type")}
            assert bridge.health.live()
    finally:
        pub.close()
        await bus.close()
    print(f"live fuzz: {ROUNDS} good batches, raw junk {raw_sent}, numbered junk {numbered_junk}, "
          f"malformed {counts}, all good in {elapsed:.2f}s")
    for reason, n in raw_sent.items():
        assert counts[reason] == n, (reason, counts[reason], n)
    assert counts["bad_batch"] > 0
    arrivals = good_arrivals(bus)
    for k in range(ROUNDS):
        msgs = arrivals[k]
        assert sorted(g.group for g in msgs) == [0, 2], f"good batch {k} arrived {len(msgs)} times"
        assert {g.seq for g in msgs} == {seq_of_good[k]}
    # junk in sequence is a malformed batch, not a loss: each one the bridge
    # could not wholly take is named by its own gap, and nothing else; no restart
    gaps = bus.records("gap")
    assert all(g.reason == "malformed" and g.gap_from == g.gap_to for g in gaps)
    assert sorted(cast(int, g.gap_from) for g in gaps) == sorted(malformed_seqs)  # a gap record names its range
    assert bus.records("restart") == []
    assert len({g.epoch for g in bus.groups()}) == 1


async def test_frames_of_valid_shape_with_a_forged_seq(nats_server: NatsServerProcess) -> None:
    """A frame with the right shape and a seq from nowhere cannot be told from
    vLLM's own: the bridge announces the hole it implies, then takes the next
    real batch for a restarted publisher. It must neither crash nor stall.
    (Only whoever binds vLLM's PUB endpoint can send such frames.)"""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url])
    bus = await BusCollector().start(nats_server.url)
    try:
        async with running_bridge(settings) as bridge:
            await anyio.sleep(0.3)
            for k in range(10):
                pub.publish(good_batch(k))
            await anyio.to_thread.run_sync(pub.wait_idle)
            await wait_good(bus, list(range(10)), timeout=10)
            for forged in (2**64 - 1, 2**63, 12):
                pub.send_raw([b"", forged.to_bytes(8, "big"), b"\xc1 junk"])
            for k in range(10, 20):
                pub.publish(good_batch(k))
            await anyio.to_thread.run_sync(pub.wait_idle)
            await wait_good(bus, list(range(10, 20)), timeout=15)
            assert bridge.health.live()
            restarts = metric(bridge, "kvbridge_restarts_total")
    finally:
        pub.close()
        await bus.close()
    assert restarts >= 1
    gaps = bus.records("gap")
    assert gaps and max(g.gap_to or 0 for g in gaps) >= 2**63 - 1


async def _survives(nats_server: NatsServerProcess, hostile: bytes, fmt: str = "msgpack") -> BusCollector:
    """Five good batches, the hostile one, five more: the bridge stays up and
    every good batch arrives."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             format=fmt)
    bus = await BusCollector(fmt).start(nats_server.url)
    try:
        async with running_bridge(settings) as bridge:
            await anyio.sleep(0.3)
            for k in range(5):
                pub.publish(good_batch(k))
            pub.publish(hostile)
            for k in range(5, 10):
                pub.publish(good_batch(k))
            await anyio.to_thread.run_sync(pub.wait_idle)
            await wait_good(bus, list(range(10)), timeout=10)
            assert bridge.health.live()
    finally:
        pub.close()
        await bus.close()
    return bus


def deep_payload(depth: int = 5000) -> bytes:
    enc = msgspec.msgpack.encode
    event = (b"\x83" + enc("type") + enc("BlockStored") + enc("block_hashes") + enc([b"h"]) + enc("extra_keys")
             + b"\x91" * depth + b"\xc0")
    return b"\x92" + enc(1.0) + b"\x91" + event


def ext_payload() -> bytes:
    event = {"type": "BlockStored", "block_hashes": [b"e" * 32], "block_size": 16, "group_idx": 0,
             "kv_cache_spec_kind": "full_attention",
             "extra_keys": [msgspec.msgpack.Ext(5, b"zz"), {(1, 2): "tuple key"}]}
    return msgspec.msgpack.encode([time.time(), [event]])


async def test_moderately_nested_junk_passes(nats_server: NatsServerProcess) -> None:
    await _survives(nats_server, deep_payload(300))


async def test_deeply_nested_junk_does_not_kill_the_bridge(nats_server: NatsServerProcess) -> None:
    """5 000 nested arrays (5 kB): msgspec raises RecursionError. Found failing
    at c8eb558 (the error escaped StreamPipeline._emit and ended the bridge)."""
    await _survives(nats_server, deep_payload(5000))


async def test_msgpack_ext_and_odd_keys_pass_in_msgpack_format(nats_server: NatsServerProcess) -> None:
    await _survives(nats_server, ext_payload(), "msgpack")


async def test_msgpack_ext_and_odd_keys_do_not_kill_a_json_bridge(nats_server: NatsServerProcess) -> None:
    """msgspec.json cannot write a msgpack Ext or an array map key. Found failing
    at c8eb558 (TypeError from MessageEncoder.group ended the bridge). The event
    itself must still arrive (its vLLM fields, if not the unwritable extras)."""
    bus = await _survives(nats_server, ext_payload(), "json")
    hashes = [h for g in bus.groups() for ev in g.events for h in getattr(ev, "block_hashes", [])]
    assert b"e" * 32 in hashes


def huge_removal() -> bytes:
    """One BlockRemoved of 40 000 hashes: a 1.3 MB NATS message, over NATS's
    default max_payload (1 MB) but well under --max-frame-bytes (16 MB)."""
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(40_000)]
    return msgspec.msgpack.encode([time.time(), [{"type": "BlockRemoved", "block_hashes": hashes, "group_idx": 0}]])


async def test_a_batch_bigger_than_nats_max_payload(nats_server: NatsServerProcess) -> None:
    """Found failing at c8eb558 (MaxPayloadError ended the bridge). The batch is
    either published in pieces, every hash once, or announced lost."""
    bus = await _survives(nats_server, huge_removal())
    removed = [h for g in bus.groups() for ev in g.events if type(ev).__name__ == "BlockRemoved"
               for h in ev.block_hashes]
    if not removed:
        assert [(g.gap_from, g.gap_to) for g in bus.records("gap")] == [(5, 5)]
    else:
        assert sorted(removed) == sorted(hashlib.sha256(str(i).encode()).digest() for i in range(40_000))
