"""A bridge's resume point is its own last message, whatever copies others'
reads left on its subjects (issue 24; docs/security.md, "What the
permissions cannot stop"). JetStream answers a read on whatever reply
subject the requester names, and the stream stores the answer there: anyone
allowed a direct get can put a copy of any message, saying anything, on top
of a bridge's subjects while it is down. Real nats-server, the bridge in
process, vLLM's wire from a real ZMQ publisher."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import msgspec
import nats
import nats.js
import pytest
from structlog.testing import capture_logs

import bridge.producer.sink.jetstream as jetstream
from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.contract import BlockStored, GroupMessage, WorkerRecord
from bridge.contract.identity import Refusal, reply_copy
from bridge.producer.sink.jetstream import ResumePoint, last_point
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import endpoints, make_settings, metric, running_bridge, wait_published
from tests.security.secure_nats import Permissions, start_server
from tests.security.test_least_privilege import _accounts_config

pytestmark = pytest.mark.anyio

STREAM = "KV_EVENTS"


def _forged_group(worker: str, epoch: int, seq: int, group: int) -> bytes:
    return msgspec.msgpack.encode(GroupMessage(
        v=1, worker=worker, dp_rank=0, epoch=epoch, seq=seq, ts=0.0, group=group, kind="full_attention",
        family="attention", kind_source="event",
        events=[BlockStored(block_hashes=[0xBAD], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                            medium="GPU", lora_name=None)]))


async def _copy_onto(nc: nats.NATS, source: str, target: str, times: int) -> None:
    """A direct get of `source`'s last message, answered onto `target`, `times` times."""
    for _ in range(times):
        await nc.publish(f"$JS.API.DIRECT.GET.{STREAM}.{source}", b"", reply=target)
    await nc.flush()


async def _stored(url: str, subjects: str) -> list[tuple[str, dict[str, str], bytes]]:
    """Every message of the stream on `subjects`, in stream order, with its stored headers."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    out = []
    sub = await js.subscribe(subjects, ordered_consumer=True)
    info = await js.stream_info(STREAM, subjects_filter=subjects)
    for _ in range(sum((info.state.subjects or {}).values())):
        msg = await sub.next_msg(timeout=5)
        out.append((msg.subject, dict(msg.headers or {}), msg.data))
    await nc.close()
    return out


async def test_copies_on_its_subjects_while_it_is_down_do_not_move_a_bridges_resume_point(
    nats_server: NatsServerProcess,
) -> None:
    """While the bridge is down, copies of a message saying the worker's
    epoch at seq +1000 are put on its group subject, and of a start record
    saying the same on its record subject. Were the last of them its resume
    point, the bridge would take the next 5 batches as stored already. It
    passes over them (counted), resumes from its own stop record, and the
    stream holds each of the 10 batches' messages once, in seq order."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             jetstream=True, worker_id="pod-c")
    workload = HybridWorkload(seed=3)
    nc = await nats.connect(nats_server.url)
    try:
        async with running_bridge(settings) as bridge:
            for _ in range(5):
                pub.publish(workload.batch(8))
            await wait_published(bridge, 5)
        js = nc.jetstream()
        last = await js.get_last_msg(STREAM, "kv.pod-c.worker")
        assert last.data is not None
        stop = msgspec.msgpack.decode(last.data, type=WorkerRecord)
        assert stop.type == "stop" and stop.seq is not None
        await js.publish("kv.other.9", _forged_group("pod-c", stop.epoch, stop.seq + 1000, 0))
        await _copy_onto(nc, "kv.other.9", "kv.pod-c.0", 3)
        await js.publish("kv.other.worker", msgspec.msgpack.encode(WorkerRecord(
            v=1, worker="pod-c", dp_rank=0, epoch=stop.epoch, type="start", ts=0.0, seq=stop.seq + 1000)))
        await _copy_onto(nc, "kv.other.worker", "kv.pod-c.worker", 1)

        async with running_bridge(settings) as bridge:
            for _ in range(5):
                pub.publish(workload.batch(8))
            await wait_published(bridge, 5)
            passed = metric(bridge, "kvbridge_read_back_refused_total", reason=Refusal.REPLY_COPY.value)
    finally:
        pub.close()
        await nc.close()

    assert passed == 4
    own, copies = [], 0
    for subject, headers, data in await _stored(nats_server.url, "kv.pod-c.>"):
        if reply_copy(headers):
            copies += 1
        elif not subject.endswith(".worker"):
            own.append(msgspec.msgpack.decode(data, type=GroupMessage))
    assert copies == 4
    keys = [(m.epoch, m.seq, m.group) for m in own]
    assert len({seq for _, seq, _ in keys}) == 10
    assert Counter(keys).most_common(1)[0][1] == 1
    assert [seq for _, seq, _ in keys] == sorted(seq for _, seq, _ in keys)


async def _own_then_copies(url: str, copies: int) -> None:
    """Worker w's group message seq 7, then `copies` copies of a forgery saying seq 5000."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name=STREAM, subjects=["kv.>"], allow_direct=True)
    await js.publish("kv.w.0", _forged_group("w", 1, 7, 0))
    await js.publish("kv.x.0", _forged_group("w", 1, 5000, 0))
    await _copy_onto(nc, "kv.x.0", "kv.w.0", copies)
    with anyio.fail_after(10):
        while (await js.stream_info(STREAM)).state.messages < 2 + copies:
            await anyio.sleep(0.05)
    await nc.close()


async def _resume_point(url: str) -> tuple[ResumePoint | None, Counter[Refusal]]:
    """Worker w's resume point as its bridge reads it, and what it passed over."""
    nc = await nats.connect(url)
    passed: Counter[Refusal] = Counter()
    try:
        return await last_point(nc.jetstream(), STREAM, "kv.w", passed), passed
    finally:
        await nc.close()


@pytest.mark.parametrize("copies", [1, 100])
async def test_the_read_steps_back_past_copies_to_the_bridges_own_last_message(
    nats_server: NatsServerProcess, copies: int,
) -> None:
    await _own_then_copies(nats_server.url, copies)
    point, passed = await _resume_point(nats_server.url)
    assert point is not None and (point.epoch, point.done_through, point.check_seq) == (1, 6, 7)
    assert passed == {Refusal.REPLY_COPY: copies}


async def test_more_copies_than_the_bound_leave_no_resume_point_not_a_forged_one(
    nats_server: NatsServerProcess, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The read is bounded (it stops stepping back once it has read
    STEP_BACK_MAX of the rank's messages): past it the bridge starts fresh,
    as with an empty stream, and says so, never taking a copy's word."""
    monkeypatch.setattr(jetstream, "STEP_BACK_MAX", 20)
    await _own_then_copies(nats_server.url, 100)
    point, passed = await _resume_point(nats_server.url)
    assert point is None
    assert 20 <= passed[Refusal.REPLY_COPY] < 100


async def test_a_user_not_allowed_the_rank_consumer_resumes_from_the_direct_get_unchecked(tmp_path: Path) -> None:
    """Permissions written before the resume read used the rank's consumer
    allow the direct get alone: the consumer is never answered, and the
    bridge resumes from the direct get's answer as it did, unchecked and
    said so, instead of waiting for ever."""
    admin = Permissions(publish=[">"], subscribe=[">"])
    bridge = Permissions(publish=["kv.w.>", f"$JS.API.DIRECT.GET.{STREAM}.kv.w.>"], subscribe=["_INBOX.>"])
    server = start_server(tmp_path, _accounts_config({"admin": ("pw-admin", admin), "bridge": ("pw-bridge", bridge)}),
                          jetstream=True)
    try:
        nc = await nats.connect(server.url, user="admin", password="pw-admin")
        js = nc.jetstream()
        await js.add_stream(name=STREAM, subjects=["kv.>"], allow_direct=True)
        await js.publish("kv.w.0", _forged_group("w", 1, 7, 0))
        await nc.close()
        nc = await nats.connect(server.url, user="bridge", password="pw-bridge")
        try:
            with capture_logs() as logs:
                point = await last_point(nc.jetstream(timeout=1.0), STREAM, "kv.w")
        finally:
            await nc.close()
    finally:
        server.stop()
    assert point is not None and (point.epoch, point.check_seq) == (1, 7)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["resume_point_unchecked"]
