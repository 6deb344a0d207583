"""The bridge killed with SIGKILL mid-stream and restarted, JetStream mode: the
stream is its memory, vLLM's replay buffer the source of what it missed."""

from __future__ import annotations

from pathlib import Path

import anyio
import nats
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.contract import GroupMessage, WorkerRecord
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import endpoints, make_settings, metric, running_bridge, wait_published, wait_until
from tests.faults.harness import (
    BridgeProcess,
    account,
    fault_batch,
    read_stream,
    report,
    soak,
    wait_http,
    wait_metric,
    wait_peer,
    wait_port_free,
)

pytestmark = pytest.mark.anyio


DEDUP_WINDOW = 0.5  # seconds, for the tests that cut the stream's tail


def _bind(ep: str) -> str:
    return ep.replace("127.0.0.1", "*")


def _bridge_args(pub_ep: str, replay_ep: str, url: str, http: int) -> list[str]:
    return ["--zmq-endpoint", pub_ep, "--replay-endpoint", replay_ep, "--nats-url", url, "--jetstream",
            "--worker-id", "fault-worker", "--http-port", str(http), "--http-host", "127.0.0.1",
            "--registry-bucket", "", "--js-ack-timeout", "1"]


async def _publish(pub: WirePublisher, first: int, count: int, rate: float) -> None:
    for k in range(first, first + count):
        pub.publish(fault_batch(0, k, 200))
        await anyio.sleep(1.0 / rate)
    await anyio.to_thread.run_sync(pub.wait_idle)


async def test_bridge_killed_mid_stream_and_restarted_jetstream(nats_server: NatsServerProcess,
                                                               tmp_path: Path) -> None:
    """SIGKILL while batches flow and acks are in flight; vLLM keeps publishing
    while no bridge listens; a new bridge resumes from the stream. Every batch
    is in the stream once, one epoch, no gap, no restart."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    http = free_port()
    args = _bridge_args(pub_ep, replay_ep, nats_server.url, http)
    rounds = 5 if soak() else 1
    per = (150, 100, 100)
    sent = 0
    procs: list[BridgeProcess] = []
    try:
        proc = BridgeProcess(args, tmp_path / "bridge-0.log").start()
        procs.append(proc)
        await wait_http(http)
        for r in range(rounds):
            # kill while the publisher is still sending: mid-batch, acks pending
            async with anyio.create_task_group() as tg:
                tg.start_soon(_publish, pub, sent, per[0], 300.0)
                await anyio.sleep(per[0] / 300.0 * 0.7)
                proc.kill9()
            sent += per[0]
            await _publish(pub, sent, per[1], 300.0)  # nobody listening
            sent += per[1]
            proc = BridgeProcess(args, tmp_path / f"bridge-{r + 1}.log").start()
            procs.append(proc)
            await wait_http(http)
            await _publish(pub, sent, per[2], 300.0)
            sent += per[2]
        # the last bridge has handed every batch to NATS; stop() settles the acks
        await wait_metric(http, "kvbridge_last_seq", lambda v: v >= sent - 1, dp_rank="0")
        rc = proc.stop()
        assert rc == 0
    finally:
        for p in procs:
            p.stop()
        pub.close()
    items = await read_stream(nats_server.url, "KV_EVENTS")
    fig = account("bridge_kill9_restart_jetstream", {0: sent}, items, notes=f"kills={rounds}")
    report(fig)
    starts = [b.reason for _, b in items if isinstance(b, WorkerRecord) and b.type == "start"]
    assert starts == ["fresh"] + ["resumed"] * rounds
    # a kill can land between the group messages of one batch: the resumed
    # bridge completes that batch (test_resume_after_a_kill_between_the_messages_
    # of_one_batch makes that moment exact)
    assert fig.lost == 0 and fig.duplicated == 0, fig.lost_seqs
    assert fig.gap_records == 0 and fig.restarts == 0 and fig.epochs == 1
    assert fig.out_of_order == 0 and fig.wrong_seq == 0


async def _run_bridge_until(settings, total: int, timeout: float = 20.0) -> None:
    """An in-process bridge until it has published `total` batches (or gives
    up waiting: the accounting after it says what is missing)."""
    async with running_bridge(settings) as bridge:
        with anyio.move_on_after(timeout):
            while metric(bridge, "kvbridge_batches_out_total") < total:
                await anyio.sleep(0.05)
        # nothing queued and every publish acked: what the bridge would still send is sent
        await wait_until(lambda: metric(bridge, "kvbridge_queue_depth") == 0
                         and metric(bridge, "kvbridge_js_in_flight_messages") == 0, what="the bridge settled")


async def _stream_tail_surgery(url: str, drop_last: int) -> None:
    """Deletes the stream's last `drop_last` messages: the state a SIGKILL at
    that instant leaves behind, made exact. The stream's de-duplication still
    remembers the deleted Msg-Ids (a killed bridge would never have sent them),
    so these tests run with a short --stream-duplicate-window and wait it out."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info("KV_EVENTS")
        for seq in range(info.state.last_seq, info.state.last_seq - drop_last, -1):
            await js.delete_msg("KV_EVENTS", seq)
    finally:
        await nc.close()
    await anyio.sleep(DEDUP_WINDOW * 3)


async def test_resume_after_a_kill_between_the_messages_of_one_batch(nats_server: NatsServerProcess) -> None:
    """The stream ends inside batch 9 (group 0 stored, group 2 not): the resumed
    bridge must publish the rest of batch 9, once. Found failing at c8eb558
    (resume took the last message's batch as complete)."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             jetstream=True, registry_bucket="", worker_id="fault-worker",
                             stream_duplicate_window=str(DEDUP_WINDOW))
    try:
        for k in range(10):
            pub.publish(fault_batch(0, k))
        await anyio.to_thread.run_sync(pub.wait_idle)
        await _run_bridge_until(settings, 10)
        # the stream now ends [... batch 9 group 0, batch 9 group 2, stop]: a kill
        # after batch 9's first message leaves [... batch 9 group 0]
        await _stream_tail_surgery(nats_server.url, 2)
        for k in range(10, 15):
            pub.publish(fault_batch(0, k))
        await anyio.to_thread.run_sync(pub.wait_idle)
        await _run_bridge_until(settings, 6, timeout=3)
    finally:
        pub.close()
    fig = account("bridge_kill9_between_group_messages", {0: 15}, await read_stream(nats_server.url, "KV_EVENTS"))
    report(fig)
    assert fig.lost == 0 and fig.duplicated == 0, fig.lost_seqs


async def test_resume_after_a_kill_right_after_a_restart_record(nats_server: NatsServerProcess) -> None:
    """The stream ends with a `restart` record (it names the new process's first
    live seq, not a published batch): the resumed bridge must publish the new
    epoch from seq 0. Found failing at c8eb558 (it resumed past seq 3)."""
    pub_ep, replay_ep = endpoints()
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             jetstream=True, registry_bucket="", worker_id="fault-worker",
                             stream_duplicate_window=str(DEDUP_WINDOW))
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    try:
        async with running_bridge(settings) as bridge:
            for k in range(5):
                pub.publish(fault_batch(0, k))
            await wait_published(bridge, 5)
            pub.close()
            await wait_port_free(pub_ep)
            await wait_port_free(replay_ep)
            # a new vLLM process; the bridge first sees its live seq 3 (0..2 before it connected)
            pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
            await wait_peer(pub_ep)
            for k in range(3):
                pub.publish(fault_batch(1, k), drop=True)
            for k in range(3, 6):
                pub.publish(fault_batch(1, k))
            await wait_published(bridge, 11)
        # the stream ends [restart(seq=3), new 0..5 (2 messages each), stop]: keep
        # everything up to the restart record, as a kill right after it would
        await _stream_tail_surgery(nats_server.url, 13)
        items = await read_stream(nats_server.url, "KV_EVENTS")
        last = items[-1][1]
        assert isinstance(last, WorkerRecord) and last.type == "restart" and last.seq == 3
        await _run_bridge_until(settings, 6, timeout=3)
    finally:
        pub.close()
    items = await read_stream(nats_server.url, "KV_EVENTS")
    fig = account("bridge_kill9_after_restart_record", {0: 5, 1: 6}, items)
    report(fig)
    assert fig.lost == 0 and fig.duplicated == 0, fig.lost_seqs
    assert all(isinstance(b, GroupMessage) or b.type != "gap" for _, b in items)
