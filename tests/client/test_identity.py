"""Identity comes from where a message arrived, never from what it says
(issue 24, point 1): a worker's credentials cover its own subjects and keys,
so every consumer takes the worker and rank from there and refuses a payload
that names another (counted per reason, logged once per source, never
applied)."""

from __future__ import annotations

import anyio
import msgspec
import nats
import pytest
import structlog
from prometheus_client import generate_latest

from bridge.client.bootstrap import BootstrapOptions, fetch
from bridge.client.bucket import SnapshotBucket
from bridge.client.connection import BusConnection
from bridge.client.identity import IdentityGuard
from bridge.client.registry import RegistryFollower
from bridge.client.subscribe import BusSubscriber
from bridge.contract import GroupInfo, RankInfo, WorkerEntry, encode_entry, registry_key
from bridge.contract.identity import Refusal, key_origin, subject_origin
from bridge.contract.snapshot import (
    SNAPSHOT_VERSION,
    RankSnapshot,
    SnapshotHead,
    SnapshotMissing,
    encode_head,
    encode_part,
    encode_snapshot,
    part_key,
    snapshot_key,
    snapshot_subject,
    split,
)
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.producer.snapshot.rebuild import replayed
from bridge.producer.telemetry.metrics import Metrics
from bridge.residency.index import ResidencyIndex
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import make_settings
from tests.client.builders import hb, msg, record, stored
from tests.client.live import wait_until

pytestmark = pytest.mark.anyio

ENC = MessageEncoder("msgpack")


async def _publish_group(nc: nats.NATS, subject: str, body, msg_id: str) -> None:
    out = ENC.group(body, SubjectBook("kv", body.worker, body.dp_rank), msg_id)
    await nc.publish(subject, out.payload, headers=out.headers)


async def _publish_record(nc: nats.NATS, subject: str, rec, msg_id: str) -> None:
    out = ENC.record(rec, SubjectBook("kv", rec.worker, rec.dp_rank), msg_id)
    await nc.publish(subject, out.payload, headers=out.headers)


def test_the_subject_names_worker_rank_and_group_in_canonical_tokens_only() -> None:
    assert subject_origin("kv.pod~20a-dp1.3") == ("pod a", 1, 3)
    assert subject_origin("kv.prod.b.worker") == ("b", 0, None)
    # Another spelling of a token is another subject, which another worker may be allowed to publish.
    for other in ("kv.a~41.0", "kv.a-dp0.0", "kv.a.07", "kv.a.x", "kv.a~zz.0", "kv..0", "kv.a.²"):
        assert subject_origin(other) is None, other
    assert key_origin(registry_key("pod a")) == ("pod a", 0)
    assert key_origin(snapshot_key("pod a", 2)) == ("pod a", 2)
    assert key_origin("pod~20a") is None


def test_a_refusal_is_counted_every_time_and_logged_once_per_source() -> None:
    guard = IdentityGuard()
    forged = msg([stored([hb(1)])], worker="b")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert not guard.message("kv.a.0", forged)
        assert not guard.message("kv.c.0", forged)
        assert guard.message("kv.b.0", forged)
    assert guard.refused == {Refusal.WORKER: 4}
    assert [(e["event"], e["source"]) for e in logs] == [("message_refused", "kv.a.0"), ("message_refused", "kv.c.0")]


async def test_a_worker_cannot_speak_for_another_on_its_own_subjects(nats_server: NatsServerProcess) -> None:
    """Worker a's credentials publish on kv.a.*: payloads that say worker b
    (stores, a restart with a later epoch), another rank, another group, or a
    record on a group subject reach no view; b's view stays b's own."""
    conn = BusConnection()
    await conn.open(make_settings(nats_url=[nats_server.url]), "identity-test")
    nc = await nats.connect(nats_server.url)
    index = ResidencyIndex()
    try:
        async with BusSubscriber(conn, "kv.>") as sub, anyio.create_task_group() as tg:
            async def feed() -> None:
                async for item in sub:
                    index.apply(item)

            tg.start_soon(feed)
            await _publish_group(nc, "kv.b.0", msg([stored([hb(1), hb(2)])], worker="b", seq=0), "b:0:1:0")
            # With a's permissions: kv.a.0 and kv.a.worker only.
            await _publish_group(nc, "kv.a.0", msg([stored([hb(9)])], worker="b", seq=1), "f1")
            await _publish_record(nc, "kv.a.worker", record("restart", worker="b", epoch=7, seq=0), "f2")
            await _publish_record(nc, "kv.a.worker", record("cleared", worker="b", seq=1), "f3")
            await _publish_group(nc, "kv.a.0", msg([stored([hb(9)])], worker="a", rank=1, seq=1), "f4")
            await _publish_group(nc, "kv.a.0", msg([stored([hb(9)])], worker="a", group=2, seq=1), "f5")
            await _publish_group(nc, "kv.a~62.0", msg([stored([hb(9)])], worker="ab", seq=1), "f6")
            # ... and what a may say for itself goes through.
            await _publish_group(nc, "kv.a.0", msg([stored([hb(5)])], worker="a", seq=1), "a:0:1:1")
            # b goes on: its later batches are applied (a forged restart would have them ignored as an old epoch).
            await _publish_group(nc, "kv.b.0", msg([stored([hb(3)])], worker="b", seq=2), "b:0:1:2")
            await wait_until(lambda: (v := index.view("b", 0)) is not None and v.last_seq == 2)
            await wait_until(lambda: index.view("a", 0) is not None)
            tg.cancel_scope.cancel()
        b = index.view("b", 0)
        assert b is not None
        assert (b.epoch, b.restarts, b.clears) == (1, 0, 0)
        assert dict(b.groups[0].trusted["GPU"].items()) == {hb(1): 1, hb(2): 1, hb(3): 1}
        assert not b.stale
        a = index.view("a", 0)
        assert a is not None and dict(a.groups[0].trusted["GPU"].items()) == {hb(5): 1}
        assert set(index.views) == {a.key, b.key}  # no view of a's rank 1, nor of "ab"
        assert sub.identity.refused == {Refusal.WORKER: 3, Refusal.RANK: 1, Refusal.GROUP: 1,
                                        Refusal.BAD_SUBJECT: 1}
    finally:
        await nc.close()
        await conn.close()


def _entry(worker: str) -> WorkerEntry:
    return WorkerEntry(worker=worker, ranks=[RankInfo(0)], groups=[GroupInfo(0, "full_attention", "attention", 16)],
                       started_at=1.0, heartbeat_ts=1.0, heartbeat_interval=5.0)


async def test_a_registry_entry_for_another_worker_under_ones_own_key_is_refused(
    nats_server: NatsServerProcess,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        kv = await nc.jetstream().create_key_value(bucket="kv_workers")
        await kv.put(registry_key("b"), encode_entry(_entry("b")))
        await kv.put(registry_key("a"), encode_entry(_entry("b")))  # a's key, b's name: a forgery
        await kv.put(registry_key("a") + "-dp1", encode_entry(_entry("a")))  # not a registry key
        await kv.put(registry_key("c"), encode_entry(_entry("c")))
        follower = RegistryFollower(nc, "kv_workers")
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run)
            await follower.loaded.wait()
            await wait_until(lambda: "c" in follower.entries)
            # The forged entry's delete (a deleting its own key) leaves b's entry alone.
            await kv.delete(registry_key("a"))
            await kv.put(registry_key("d"), encode_entry(_entry("d")))
            await wait_until(lambda: "d" in follower.entries)
            tg.cancel_scope.cancel()
        assert set(follower.entries) == {"b", "c", "d"}
        assert follower.identity.refused == {Refusal.WORKER: 1, Refusal.RANK: 1}
    finally:
        await nc.close()


def _snapshot(worker: str, dp_rank: int) -> RankSnapshot:
    return RankSnapshot(v=SNAPSHOT_VERSION, worker=worker, dp_rank=dp_rank, epoch=1, taken_at=1.0, through="x")


async def test_a_snapshot_of_another_rank_is_refused_from_the_service_and_the_bucket(
    nats_server: NatsServerProcess,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        forged = _snapshot("b", 0)
        data = encode_snapshot(forged)
        parts = split(forged, data, "s1", 1 << 20)

        async def answer(m) -> None:
            await nc.publish(m.reply, encode_part(parts[0]))

        await nc.subscribe(snapshot_subject("kv", "a", 0), cb=answer)  # a's service subject, b's snapshot
        kv = await nc.jetstream().create_key_value(bucket="kv_snapshots")
        key = snapshot_key("a", 0)
        head = SnapshotHead(v=1, worker="b", dp_rank=0, id="s1", slot="a", parts=1, epoch=1, stream_seq=0,
                            taken_at=1.0, bytes=len(data))
        await kv.put(key, encode_head(head))
        await kv.put(part_key(key, "a", 0), encode_part(parts[0]))
        guard = IdentityGuard()
        bucket = SnapshotBucket(nc.jetstream(), "kv_snapshots")
        got, source = await fetch(nc, BootstrapOptions(timeout_s=2.0), bucket, "a", 0, guard)
        assert type(got) is SnapshotMissing and source.source == "none"
        assert "another rank" in got.reason
        assert guard.refused == {Refusal.WORKER: 2}

        # A head that says a while its snapshot says b is refused too.
        await kv.put(key, encode_head(msgspec.structs.replace(head, worker="a")))
        guard = IdentityGuard()
        got, _ = await fetch(nc, BootstrapOptions(timeout_s=2.0), bucket, "a", 0, guard)
        assert type(got) is SnapshotMissing and guard.refused[Refusal.WORKER] == 2
    finally:
        await nc.close()


def test_the_bridges_rebuild_refuses_what_its_subjects_do_not_say() -> None:
    """Messages a rebuild reads back from the rank's own subjects are the rank's
    only when their payload agrees."""
    keeper = ResidencyKeeper("a", ranks=(0,))
    book = SubjectBook("kv", "a", 0)
    ok = ENC.group(msg([stored([hb(1)])], worker="a", seq=0), book, "a:0:1:0")
    assert replayed(keeper, 0, dict(ok.headers), ok.payload, 1, ok.subject)
    forged = ENC.group(msg([stored([hb(2)])], worker="b", seq=1), SubjectBook("kv", "b", 0), "f1")
    assert not replayed(keeper, 0, dict(forged.headers), forged.payload, 2, "kv.a.0")
    restart = ENC.record(record("restart", worker="a", rank=1, epoch=9, seq=0), SubjectBook("kv", "a", 1), "f2")
    assert not replayed(keeper, 0, dict(restart.headers), restart.payload, 3, "kv.a.worker")
    keeper.catch_up()
    view = keeper.index.view("a", 0)
    assert view is not None and dict(view.groups[0].trusted["GPU"].items()) == {hb(1): 1}
    assert keeper.index.view("b", 0) is None and keeper.index.view("a", 1) is None
    assert keeper.refused == {Refusal.WORKER: 1, Refusal.RANK: 1}
    # and /metrics counts them, by reason
    metrics = Metrics()
    metrics.watch_residency(keeper.levels, keeper.refusals)
    scraped = generate_latest(metrics.registry).decode()
    for reason, n in (("worker_mismatch", 1), ("rank_mismatch", 1), ("reply_copy", 0)):
        assert f'kvbridge_residency_refused_messages_total{{reason="{reason}"}} {n}.0' in scraped
