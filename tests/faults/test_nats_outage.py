"""NATS goes away under the bridge: killed with SIGKILL and restarted, or frozen
with SIGSTOP past the bridge's buffer bound."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import nats.errors
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import endpoints, make_settings, metric, running_bridge
from tests.faults.harness import (
    BridgeProcess,
    LiveBus,
    account,
    capture_stream,
    fault_batch,
    read_stream,
    report,
    soak,
    stream_batches,
    wait_http,
    wait_metric,
    wait_stable,
)

pytestmark = pytest.mark.anyio


def _bind(ep: str) -> str:
    return ep.replace("127.0.0.1", "*")


async def _publish(pub: WirePublisher, first: int, count: int, rate: float, pad: int = 0) -> None:
    """`count` batches at about `rate` per second, numbered from `first`."""
    for k in range(first, first + count):
        pub.publish(fault_batch(0, k, pad))
        if rate:
            await anyio.sleep(1.0 / rate)
    await anyio.to_thread.run_sync(pub.wait_idle)


async def _stable_count(url: str, stream: str) -> int:
    async def read() -> int:
        try:
            return await stream_batches(url, stream)
        except (OSError, TimeoutError, nats.errors.Error):  # JetStream may still be recovering
            return -1

    return int(await wait_stable(read, settle=1.0, timeout=40))


async def test_nats_killed_and_restarted_core_mode(restartable_nats: NatsServerProcess) -> None:
    """Core NATS has no acks: what the bridge had written to the socket when the
    server died is gone, and nothing can tell. What the design promises is the
    rest: everything published while NATS was away is buffered and arrives after
    the restart, in order, once."""
    server = restartable_nats
    await capture_stream(server.url)
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[server.url])
    bus = await LiveBus().start(server.url)
    scale = 5 if soak() else 1
    before, during, after = 150 * scale, 100 * scale, 100 * scale
    try:
        async with running_bridge(settings) as bridge:
            await _publish(pub, 0, before, rate=300)
            kill_seq = pub.next_seq
            server.kill()
            t0 = time.monotonic()
            await _publish(pub, before, during, rate=100)
            # the bridge saw NATS go: everything since is in its queue
            assert metric(bridge, "kvbridge_nats_connected") == 0
            server.start()
            outage = time.monotonic() - t0
            await _publish(pub, before + during, after, rate=300)
            await _stable_count(server.url, "FAULT_CAPTURE")
            reconnects = metric(bridge, "kvbridge_nats_reconnects_total")
    finally:
        pub.close()
    # the bridge's last word: whatever it published before reached the live bus
    await bus.wait_records("stop")
    await bus.close()
    sent = before + during + after
    fig = account("nats_kill9_restart_core", {0: sent}, await read_stream(server.url, "FAULT_CAPTURE"),
                  notes=f"outage={outage:.1f}s reconnects={reconnects:.0f} kill_at_seq={kill_seq}")
    live = account("live", {0: sent}, bus.items)
    fig.duplicated = max(fig.duplicated, live.duplicated)
    report(fig)
    assert reconnects >= 1
    assert fig.duplicated == 0 and fig.out_of_order == 0 and fig.wrong_seq == 0
    # only batches in flight at the kill can be gone; none published after it
    assert all(last < kill_seq for _, last in fig.lost_seqs), fig.lost_seqs
    assert fig.lost <= 50, "more than what a socket holds in flight"


async def test_nats_killed_and_restarted_jetstream_mode(restartable_nats: NatsServerProcess) -> None:
    """With JetStream and the server's store kept, acks make the outage lossless:
    unacked messages are published again with their Nats-Msg-Id and the stream
    keeps each once."""
    server = restartable_nats
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[server.url],
                             jetstream=True, js_ack_timeout="1", registry_bucket="")
    scale = 5 if soak() else 1
    before, during, after = 150 * scale, 100 * scale, 100 * scale
    try:
        async with running_bridge(settings) as bridge:
            await _publish(pub, 0, before, rate=300)
            server.kill()
            t0 = time.monotonic()
            await _publish(pub, before, during, rate=100)
            server.start()
            outage = time.monotonic() - t0
            await _publish(pub, before + during, after, rate=300)
            with anyio.fail_after(60):
                while metric(bridge, "kvbridge_batches_out_total") < before + during + after:
                    await anyio.sleep(0.1)
            republished = metric(bridge, "kvbridge_publish_errors_total")
        # leaving the block stopped the bridge: acks settled, stream flushed
    finally:
        pub.close()
    sent = before + during + after
    fig = account("nats_kill9_restart_jetstream", {0: sent}, await read_stream(server.url, "KV_EVENTS"),
                  notes=f"outage={outage:.1f}s publish_errors={republished:.0f}")
    report(fig)
    assert fig.lost == 0 and fig.duplicated == 0
    assert fig.out_of_order == 0 and fig.wrong_seq == 0 and fig.gap_records == 0


async def _freeze(server: NatsServerProcess, name: str, **bound: str):
    """SIGSTOP: the server accepts connections but reads nothing. The bridge's
    socket and nats-py's pending buffer fill, publishing blocks, and the bounded
    queue (`bound`: 40 batches by default) drops its oldest batches. Then SIGCONT."""
    bound = bound or {"max_buffered_batches": "40"}
    await capture_stream(server.url)
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    # relayed whole: the padding is token ids, which --prompt-data redact would shrink to 1 byte each
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[server.url],
                             prompt_data="relay", **bound)
    # ~60 kB per batch, 400 a second: 600 batches are 36 MB, far beyond nats-py's
    # 8 MB pending buffer plus the loopback socket buffers
    pad, frozen_batches = 20_000, 600 * (3 if soak() else 1)
    try:
        async with running_bridge(settings) as bridge:
            await _publish(pub, 0, 20, rate=200, pad=pad)
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)
            try:
                await _publish(pub, 20, frozen_batches, rate=400, pad=pad)
                with anyio.fail_after(30):
                    while metric(bridge, "kvbridge_batches_in_total") < 20 + frozen_batches:
                        await anyio.sleep(0.05)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            await _publish(pub, 20 + frozen_batches, 20, rate=200, pad=pad)
            await _stable_count(server.url, "FAULT_CAPTURE")
            overflow = metric(bridge, "kvbridge_dropped_total", reason="queue_overflow")
            gap_metric = metric(bridge, "kvbridge_gap_batches_total")
    finally:
        pub.close()
    sent = 40 + frozen_batches
    return account(name, {0: sent}, await read_stream(server.url, "FAULT_CAPTURE"),
                   notes=f"bound={bound} queue_overflow_metric={overflow:.0f} gap_batches_metric={gap_metric:.0f}")


async def test_nats_frozen_past_the_buffer_bound(restartable_nats: NatsServerProcess) -> None:
    """After SIGCONT the backlog arrives in order, once, and every batch the
    bounded queue dropped is named by a `gap` record (queue_overflow), and only
    those. Found failing at c8eb558: the queue could drop the batch the sink was
    blocked publishing and then pop the next one unpublished (one silent loss
    per overflow, and a gap record naming a batch that did arrive)."""
    fig = await _freeze(restartable_nats, "nats_sigstop_past_buffer_bound")
    report(fig)
    assert fig.lost > 0, "the freeze did not overflow the bound: the test proves nothing"
    assert fig.gap_records >= 1
    assert fig.out_of_order == 0 and fig.wrong_seq == 0 and fig.partial == 0
    assert fig.duplicated == 0
    assert fig.unannounced == 0, f"losses without a gap record: {fig.lost_seqs}"
    assert fig.overannounced == 0, "a gap record names a batch that was published"


async def test_nats_frozen_past_the_byte_bound(restartable_nats: NatsServerProcess) -> None:
    """The same freeze bounded by bytes (2 MiB, about 35 of these 60 kB
    batches) with a batch bound far away: large batches shed by size, each loss
    named, nothing else lost."""
    fig = await _freeze(restartable_nats, "nats_sigstop_past_byte_bound",
                        max_buffered_batches="10000", max_buffered_bytes=str(2 * 1024 * 1024))
    report(fig)
    assert fig.lost > 0, "the freeze did not overflow the byte bound: the test proves nothing"
    assert fig.out_of_order == 0 and fig.wrong_seq == 0 and fig.partial == 0 and fig.duplicated == 0
    assert fig.unannounced == 0, f"losses without a gap record: {fig.lost_seqs}"
    assert fig.overannounced == 0, "a gap record names a batch that was published"


async def test_nats_killed_with_acks_in_flight_jetstream(restartable_nats: NatsServerProcess, tmp_path: Path) -> None:
    """The worst moment for JetStream: batches written to the socket but never
    stored (nats-server frozen, then killed, so the kernel drops what it held
    for it), NATS back, a little more traffic. Within a few ack timeouts the
    lost batches must be in the stream again; then the bridge is killed too and
    a new one resumes: nothing lost, nothing twice, in order. Found failing at
    c8eb558: unacked futures were only settled once 256 newer ones queued behind
    them, so the lost batches stayed missing (and a bridge killed meanwhile
    resumed after them)."""
    server = restartable_nats
    pub_ep, replay_ep = endpoints()
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    http = free_port()
    args = ["--zmq-endpoint", pub_ep, "--replay-endpoint", replay_ep, "--nats-url", server.url, "--jetstream",
            "--worker-id", "fault-worker", "--http-port", str(http), "--http-host", "127.0.0.1",
            "--registry-bucket", "", "--js-ack-timeout", "1"]
    first = BridgeProcess(args, tmp_path / "bridge-0.log").start()
    second = None
    try:
        await wait_http(http)
        await _publish(pub, 0, 20, rate=200)
        await wait_metric(http, "kvbridge_batches_out_total", lambda v: v >= 20)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        await _publish(pub, 20, 5, rate=200)  # written to the socket, never stored
        await wait_metric(http, "kvbridge_batches_out_total", lambda v: v >= 25)
        server.kill()
        server.start()
        await wait_http(http)
        await _publish(pub, 25, 10, rate=100)
        # within three ack timeouts every batch is in the stream again
        deadline = time.monotonic() + 3.0
        while True:
            meanwhile = account("nats_kill9_acks_in_flight", {0: 35}, await read_stream(server.url, "KV_EVENTS"))
            if meanwhile.lost == 0 or time.monotonic() >= deadline:
                break
            await anyio.sleep(0.1)
        report(meanwhile)
        first.kill9()
        second = BridgeProcess(args, tmp_path / "bridge-1.log").start()
        await wait_http(http)
        await _publish(pub, 35, 5, rate=100)
        await wait_metric(http, "kvbridge_last_seq", lambda v: v >= 39, dp_rank="0")
        assert second.stop() == 0
    finally:
        first.stop()
        if second is not None:
            second.stop()
        pub.close()
    fig = account("nats_kill9_acks_in_flight_then_bridge_kill9", {0: 40}, await read_stream(server.url, "KV_EVENTS"))
    report(fig)
    assert meanwhile.lost == 0 and meanwhile.out_of_order == 0, meanwhile.lost_seqs
    assert fig.lost == 0 and fig.duplicated == 0 and fig.out_of_order == 0, fig.lost_seqs
