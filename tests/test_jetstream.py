"""JetStream mode: acks, de-duplication, resume after a bridge crash, vLLM restart detection."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import anyio
import msgspec
import nats
import nats.js.api
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.contract import GroupMessage, WorkerRecord
from bridge.producer.config import Settings
from bridge.producer.service import Bridge
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import endpoints, make_settings, metric, running_bridge, wait_published

pytestmark = pytest.mark.anyio


async def stream_contents(url: str, stream: str = "KV_EVENTS") -> list[tuple[str, GroupMessage | WorkerRecord]]:
    """Everything the stream holds, in stream order."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    info = await js.stream_info(stream)
    out: list[tuple[str, GroupMessage | WorkerRecord]] = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg(stream, seq)
        assert raw.subject is not None and raw.data is not None
        type_: type[GroupMessage | WorkerRecord] = WorkerRecord if raw.subject.endswith(".worker") else GroupMessage
        out.append((raw.subject, msgspec.msgpack.decode(raw.data, type=type_)))
    await nc.close()
    return out


def group_keys(contents: list[tuple[str, GroupMessage | WorkerRecord]]) -> Counter[tuple[int, int, int]]:
    return Counter((b.epoch, b.seq, b.group) for _, b in contents if isinstance(b, GroupMessage))


async def test_jetstream_mode_stores_every_batch_once(nats_server: NatsServerProcess) -> None:
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             jetstream=True, stream_max_age="600")
    workload = HybridWorkload(seed=1)
    try:
        async with running_bridge(settings) as bridge:
            for _ in range(50):
                pub.publish(workload.batch(16))
            await wait_published(bridge, 50)
            assert metric(bridge, "kvbridge_js_window_waits_total") == 0  # 50 batches fit the window
    finally:
        pub.close()
    contents = await stream_contents(nats_server.url)
    keys = group_keys(contents)
    assert {seq for _, seq, _ in keys} == set(range(50))
    assert max(keys.values()) == 1
    nc = await nats.connect(nats_server.url)
    info = await nc.jetstream().stream_info("KV_EVENTS")
    await nc.close()
    assert info.config.subjects == ["kv.>"] and info.config.allow_direct and info.config.max_age == 600
    # Bounded by bytes, oldest first, not per subject (nats-server would delete
    # one old message scattered through its files for every new one).
    assert info.config.max_bytes == 1024**3 and info.config.max_msgs_per_subject == -1
    assert info.config.discard == nats.js.api.DiscardPolicy.OLD


async def test_a_small_byte_window_still_stores_large_batches_once(nats_server: NatsServerProcess) -> None:
    """512-event batches (about 190 kB each) through a 1 MiB ack window: the
    publisher waits for acks by bytes, and nothing is lost or stored twice."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             jetstream=True, js_max_pending_bytes=str(1024 * 1024))
    workload = HybridWorkload(seed=2)
    peak = 0

    gauge_peak = 0.0

    async def watch(bridge: Bridge) -> None:
        nonlocal peak, gauge_peak
        while True:
            peak = max(peak, bridge.sink.in_flight()[1])
            gauge_peak = max(gauge_peak, metric(bridge, "kvbridge_js_in_flight_messages"))
            await anyio.sleep(0)

    try:
        async with running_bridge(settings) as bridge, anyio.create_task_group() as tg:
            tg.start_soon(watch, bridge)
            for _ in range(40):
                pub.publish(workload.batch(512))
            await wait_published(bridge, 40)
            tg.cancel_scope.cancel()
            # Publishing waited for acks, and the counters say so.
            assert metric(bridge, "kvbridge_js_window_waits_total") >= 1
            assert metric(bridge, "kvbridge_js_window_wait_seconds_total") > 0
            # The gauges follow the window and come back to 0 once every ack is in.
            with anyio.fail_after(10):
                while metric(bridge, "kvbridge_js_in_flight_messages") or metric(bridge, "kvbridge_js_in_flight_bytes"):
                    assert metric(bridge, "kvbridge_js_in_flight_bytes") == bridge.sink.in_flight()[1]
                    await anyio.sleep(0.01)
    finally:
        pub.close()
    keys = group_keys(await stream_contents(nats_server.url))
    assert {seq for _, seq, _ in keys} == set(range(40))
    assert max(keys.values()) == 1
    # The bound holds to within the one batch that crossed it.
    assert 256 * 1024 < peak <= 1024 * 1024 + 256 * 1024
    assert gauge_peak >= 1


def _spawn_bridge(pub_ep: str, replay_ep: str, url: str, http: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "bridge", "run", "--zmq-endpoint", pub_ep, "--replay-endpoint", replay_ep,
         "--nats-url", url, "--jetstream", "--worker-id", "js-worker", "--http-port", str(http),
         "--http-host", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ),
    )


async def _wait_ready(http: int) -> None:
    import urllib.request

    def probe() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    with anyio.fail_after(30):
        while not await anyio.to_thread.run_sync(probe):
            await anyio.sleep(0.1)


async def test_bridge_killed_and_restarted_loses_nothing_and_duplicates_nothing(nats_server: NatsServerProcess) -> None:
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    workload = HybridWorkload(seed=2)
    http = free_port()
    first = _spawn_bridge(pub_ep, replay_ep, nats_server.url, http)
    second = None
    try:
        await _wait_ready(http)
        for _ in range(200):
            pub.publish(workload.batch(8))
            await anyio.sleep(0.002)
        first.send_signal(signal.SIGKILL)
        first.wait()
        # vLLM keeps publishing while no bridge listens
        for _ in range(100):
            pub.publish(workload.batch(8))
        pub.wait_idle()
        second = _spawn_bridge(pub_ep, replay_ep, nats_server.url, http)
        await _wait_ready(http)
        for _ in range(50):
            pub.publish(workload.batch(8))
        pub.wait_idle()
        total = pub.next_seq
        assert total == 350
        with anyio.fail_after(30):
            while True:
                keys = group_keys(await stream_contents(nats_server.url))
                if {seq for _, seq, _ in keys} >= set(range(total)):
                    break
                await anyio.sleep(0.2)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=20)
        pub.close()
    contents = await stream_contents(nats_server.url)
    keys = group_keys(contents)
    epochs = {epoch for epoch, _, _ in keys}
    assert len(epochs) == 1, "the resumed bridge continues the same epoch"
    seqs = Counter(seq for _, seq, _ in keys)
    assert set(seqs) == set(range(total)), "lost batches"
    assert max(keys.values()) == 1, "a batch reached the stream twice"
    records = [b for _, b in contents if isinstance(b, WorkerRecord)]
    assert [r.reason for r in records if r.type == "start"] == ["fresh", "resumed"]
    assert not [r for r in records if r.type in ("gap", "restart")]


async def test_resume_recognises_a_vllm_restart_while_the_bridge_was_down(nats_server: NatsServerProcess) -> None:
    pub_ep, replay_ep = endpoints()
    bind = (pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             jetstream=True)
    workload = HybridWorkload(seed=3)
    pub = WirePublisher(*bind)
    async with running_bridge(settings) as bridge:
        for _ in range(30):
            pub.publish(workload.batch(8))
        await wait_published(bridge, 30)
    pub.close()
    # a new vLLM process: seq starts over, and it has already published 10 batches
    time.sleep(0.2)
    pub = WirePublisher(*bind)
    for _ in range(10):
        pub.publish(workload.batch(8))
    pub.wait_idle()
    try:
        async with running_bridge(settings) as bridge:
            for _ in range(5):
                pub.publish(workload.batch(8))
            await wait_published(bridge, 15)
            assert metric(bridge, "kvbridge_restarts_total") == 1
    finally:
        pub.close()
    contents = await stream_contents(nats_server.url)
    keys = group_keys(contents)
    epochs = sorted({epoch for epoch, _, _ in keys})
    assert len(epochs) == 2
    assert {seq for e, seq, _ in keys if e == epochs[0]} == set(range(30))
    assert {seq for e, seq, _ in keys if e == epochs[1]} == set(range(15))
    restarts = [b for _, b in contents if isinstance(b, WorkerRecord) and b.type == "restart"]
    assert len(restarts) == 1 and restarts[0].epoch == epochs[1]


def _publisher_and_settings(nats_url: str) -> tuple[WirePublisher, Settings]:
    """A vLLM-wire publisher and JetStream-mode settings for a bridge reading it."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    return pub, make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_url], jetstream=True)


async def test_a_message_the_stream_refuses_for_good_is_given_up_and_named_by_a_gap(
    nats_server: NatsServerProcess,
) -> None:
    """An operator's stream that takes at most 8 KiB per message refuses the
    slices of one 512-event batch every time. The bridge gives them up after a
    few tries, names that batch by a `gap` record, and keeps storing the later
    batches: one message the stream never takes does not stop the worker's feed."""
    nc = await nats.connect(nats_server.url)
    await nc.jetstream().add_stream(name="KV_EVENTS", subjects=["kv.>"], max_msg_size=8192, allow_direct=True)
    await nc.close()
    pub, settings = _publisher_and_settings(nats_server.url)
    workload = HybridWorkload(seed=3)
    try:
        async with running_bridge(settings) as bridge:
            for size in (2, 2, 512, 2, 2):
                pub.publish(workload.batch(size))
            await wait_published(bridge, 5)
            with anyio.fail_after(20):
                while metric(bridge, "kvbridge_gaps_total", reason="refused") < 1:
                    await anyio.sleep(0.05)
            refused = metric(bridge, "kvbridge_js_refused_total")
    finally:
        pub.close()
    assert refused >= 1
    contents = await stream_contents(nats_server.url)
    stored = {b.seq for _, b in contents if isinstance(b, GroupMessage)}
    assert {0, 1, 3, 4} <= stored
    gaps = [(r.gap_from, r.gap_to, r.reason) for _, r in contents if isinstance(r, WorkerRecord) and r.type == "gap"]
    assert gaps == [(2, 2, "refused")]  # one record for the batch, however many of its slices were refused


async def test_a_stream_deleted_under_a_running_bridge_is_made_again(nats_server: NatsServerProcess) -> None:
    """Someone deletes the stream while the bridge runs: publishes find no
    stream (503). The bridge makes the stream again and stores what follows,
    instead of stopping or retrying forever."""
    pub, settings = _publisher_and_settings(nats_server.url)
    workload = HybridWorkload(seed=4)
    try:
        async with running_bridge(settings) as bridge:
            for _ in range(3):
                pub.publish(workload.batch(4))
            await wait_published(bridge, 3)
            nc = await nats.connect(nats_server.url)
            await nc.jetstream().delete_stream("KV_EVENTS")
            await nc.close()
            for _ in range(3):
                pub.publish(workload.batch(4))
            await wait_published(bridge, 6)
            with anyio.fail_after(20):
                while True:
                    try:
                        stored = {b.seq for _, b in await stream_contents(nats_server.url)
                                  if isinstance(b, GroupMessage)}
                    except nats.js.errors.APIError:  # no stream yet, or one still empty
                        stored = set()
                    if {3, 4, 5} <= stored:
                        break
                    await anyio.sleep(0.1)
    finally:
        pub.close()


async def test_a_resume_point_that_does_not_answer_yet_is_waited_for_not_a_crash(
    nats_server: NatsServerProcess, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new replicated stream's replicas may not answer a direct get for a
    moment (NoRespondersError). Found at 8c18139 on a three-server cluster: the
    error left the task group and the bridge exited 1. Now it is not ready,
    says so, and tries again."""
    import bridge.producer.sink.resume as resume
    from bridge.producer.sink.jetstream import last_point

    calls = {"n": 0}
    readiness: list[bool] = []

    async def flaky(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] <= 3:
            raise nats.errors.NoRespondersError
        return await last_point(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(resume, "last_point", flaky)
    pub, settings = _publisher_and_settings(nats_server.url)
    workload = HybridWorkload(seed=5)
    bridge = Bridge(settings)
    stop = anyio.Event()

    async def watch() -> None:
        while not stop.is_set():
            readiness.append(bridge.health.ready())
            await anyio.sleep(0.05)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(bridge.run, stop)
            tg.start_soon(watch)
            with anyio.fail_after(15):
                await bridge.ready.wait()
            assert bridge.health.stream_ready
            for _ in range(5):
                pub.publish(workload.batch(4))
            await wait_published(bridge, 5)
            stop.set()
    finally:
        pub.close()
    assert calls["n"] >= 4
    assert readiness and not readiness[0], "ready before the resume point answered"
    keys = group_keys(await stream_contents(nats_server.url))
    assert {seq for _, seq, _ in keys} == set(range(5))


async def test_a_bridge_restarted_with_no_batch_in_between_stores_its_start_and_stop(
    nats_server: NatsServerProcess,
) -> None:
    """Two bridge runs that start and stop at the same seq: each run's start
    and stop records reach the stream (the second run's stop is what a stream
    reader must see last, or it holds the worker as watched)."""
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             jetstream=True, worker_id="pod-r")
    workload = HybridWorkload(seed=2)
    try:
        async with running_bridge(settings) as bridge:
            for _ in range(5):
                pub.publish(workload.batch(8))
            await wait_published(bridge, 5)
        for _ in range(2):
            async with running_bridge(settings):
                await anyio.sleep(0.3)
    finally:
        pub.close()
    records = [b.type for _, b in await stream_contents(nats_server.url) if isinstance(b, WorkerRecord)]
    assert records == ["start", "stop", "start", "stop", "start", "stop"]
