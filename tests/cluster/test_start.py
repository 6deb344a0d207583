"""A bridge starting against a cluster whose replicated stream cannot be made
or read yet: not ready, saying why, retrying; never a crash. Found at 8c18139:
a fresh R3 stream's resume point (a direct get its replicas did not answer
yet) raised NoRespondersError out of the task group, exit 1, 1 start in 6."""

from __future__ import annotations

from pathlib import Path

import anyio
import nats
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.contract import BlockHash
from bridge.runtime.ports import free_port
from tests.cluster.harness import NatsCluster, read_stream
from tests.faults.harness import BridgeProcess, fault_batch, http_get, ident, wait_http

pytestmark = pytest.mark.anyio


async def test_a_cluster_without_jetstream_quorum_keeps_the_bridge_waiting(cluster: NatsCluster,
                                                                           tmp_path: Path) -> None:
    """One server of three up: no JetStream meta leader, the R3 stream can be
    neither made nor read. The bridge stays up and not ready, says why, and
    once the other two are back makes the stream and relays everything vLLM
    published meanwhile (replay)."""
    await cluster.wait_jetstream()
    down = cluster.nodes[1:]
    for node in down:
        node.kill9()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    http = free_port()
    urls = [arg for node in cluster.nodes for arg in ("--nats-url", node.url)]
    bridge = BridgeProcess(["--zmq-endpoint", pub_ep, "--replay-endpoint", replay_ep, *urls, "--jetstream",
                            "--stream-replicas", "3", "--worker-id", "starter", "--http-port", str(http),
                            "--http-host", "127.0.0.1", "--registry-bucket", ""], tmp_path / "bridge.log").start()
    try:
        with anyio.fail_after(30):
            while not [e for e in bridge.logs() if e.get("event") == "stream_not_ready"]:
                await anyio.sleep(0.2)
        for k in range(20):  # vLLM publishes meanwhile: replay has it
            pub.publish(fault_batch(0, k))
        await anyio.sleep(1.0)
        assert bridge.proc is not None and bridge.proc.poll() is None, "the bridge exited"
        status, _ = await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{http}/readyz")
        assert status == 503
        for node in down:
            await anyio.to_thread.run_sync(node.start)
        await wait_http(http, timeout=60)
        for k in range(20, 40):
            pub.publish(fault_batch(0, k))
        await anyio.to_thread.run_sync(pub.wait_idle)
        with anyio.fail_after(30):
            while True:
                stored = await read_stream(cluster.urls)
                lookup: dict[BlockHash, int] = {ident(0, k): k for k in range(40)}
                seen = {lookup.get(s.body.events[0].block_hashes[0]) for s in stored
                        if hasattr(s.body, "events") and s.body.events and s.body.events[0].block_hashes}
                if set(range(40)) <= seen:
                    break
                await anyio.sleep(0.3)
        assert await anyio.to_thread.run_sync(bridge.stop) == 0
    finally:
        bridge.stop()
        pub.close()
    nc = await nats.connect(cluster.urls[0])
    info = await nc.jetstream().stream_info("KV_EVENTS")
    await nc.close()
    assert info.config.num_replicas == 3
    events = [e.get("event") for e in bridge.logs()]
    assert "stream_not_ready" in events
    assert "stream_created" in events or "stream_verified" in events
