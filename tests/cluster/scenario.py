"""One cluster fault while vLLM keeps publishing: a bridge (a real `kv-bridge
run` process, JetStream, `--stream-replicas 3`, all three URLs), a core
subscriber on a server the fault spares, the fault injected and healed at
given batches, then the stream read back from the cluster and accounted."""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio

from bridge.apps.demo.publisher import WirePublisher
from bridge.runtime.ports import free_port
from tests.cluster.harness import (
    ClusterFigures,
    ClusterNode,
    NatsCluster,
    account_live,
    account_stream,
    read_stream,
    stream_count,
)
from tests.faults.harness import GROUPS, BridgeProcess, LiveBus, fault_batch, http_get, ident, metric_value, wait_http

STREAM = "KV_EVENTS"
WORKER = "cluster-worker"


@dataclass
class Roles:
    """Who is who when the fault strikes."""

    cluster: NatsCluster
    connected: ClusterNode  # the server the bridge is connected to
    leader: ClusterNode  # the stream's leader
    target: ClusterNode | None = None  # the server the fault hits
    spare: ClusterNode | None = None  # a server the fault spares (the core subscriber's)


Step = Callable[[Roles], Awaitable[None]]


@dataclass
class Fault:
    name: str
    pick: Callable[[Roles], ClusterNode | None]
    inject: Step
    heal: Step | None = None
    # Move the stream's leader off the bridge's server first (before traffic),
    # so that a fault on one of them spares the other.
    separate: bool = False
    # Further steps, by batch: (batch, step).
    then: tuple[tuple[int, Step], ...] = ()
    bridge_args: list[str] = field(default_factory=list)


def _bind(ep: str) -> str:
    return ep.replace("127.0.0.1", "*")


async def run_fault(cluster: NatsCluster, tmp_path: Path, fault: Fault, *, total: int, fault_at: int,
                    heal_at: int, rate: float = 200.0) -> tuple[ClusterFigures, BridgeProcess, Roles]:
    await cluster.wait_jetstream()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = WirePublisher(_bind(pub_ep), _bind(replay_ep))
    http = free_port()
    urls = [arg for url in cluster.urls for arg in ("--nats-url", url)]
    args = ["--zmq-endpoint", pub_ep, "--replay-endpoint", replay_ep, *urls, "--jetstream", "--stream-replicas", "3",
            "--worker-id", WORKER, "--http-port", str(http), "--http-host", "127.0.0.1", "--registry-bucket", "",
            *fault.bridge_args]
    bridge = BridgeProcess(args, tmp_path / "bridge.log").start()
    bus: LiveBus | None = None
    try:
        await wait_http(http, timeout=60)
        connected = await cluster.wait_connected_node(f"kv-bridge {WORKER}")
        leader = await cluster.stream_leader(STREAM)
        while fault.separate and leader is connected:
            await cluster.step_down(STREAM)
            await anyio.sleep(0.5)
            leader = await cluster.stream_leader(STREAM)
        roles = Roles(cluster, connected, leader)
        roles.target = fault.pick(roles)
        spare = [n for n in cluster.nodes if n is not roles.target and n is not connected] or \
                [n for n in cluster.nodes if n is not roles.target]
        roles.spare = spare[0]
        bus = await LiveBus().start(roles.spare.url)
        await bus.wait_interest(connected.url)
        for k in range(total):
            if k == fault_at:
                await fault.inject(roles)
            if k == heal_at and fault.heal is not None:
                await fault.heal(roles)
            for at, step in fault.then:
                if k == at:
                    await step(roles)
            pub.publish(fault_batch(0, k))
            await anyio.sleep(1.0 / rate)
        await anyio.to_thread.run_sync(pub.wait_idle)
        await _settle(cluster, http)
        metrics = http_get(f"http://127.0.0.1:{http}/metrics")[1]
        code = await anyio.to_thread.run_sync(bridge.stop)
        assert code == 0, f"bridge exited {code}"
    finally:
        bridge.stop()
        pub.close()
        if bus is not None:
            await anyio.sleep(0.3)
            await bus.close()
    lookup = {ident(0, k): k for k in range(total)}
    stored = await read_stream(cluster.urls, STREAM)
    fig = account_stream(fault.name, total, stored, GROUPS, lookup.get)
    assert bus is not None
    account_live(fig, total, bus.items, GROUPS, lookup.get)
    fig.notes = (f"target={roles.target.name if roles.target else '-'} connected={roles.connected.name} "
                 f"leader={roles.leader.name} recoveries={metric_value(metrics, 'kvbridge_js_recoveries_total'):.0f} "
                 f"publish_errors={metric_value(metrics, 'kvbridge_publish_errors_total'):.0f}")
    report(fig)
    return fig, bridge, roles


async def _settle(cluster: NatsCluster, http: int, timeout: float = 90.0) -> None:
    """Until the bridge has nothing queued or unacked and the stream stops growing."""
    with anyio.fail_after(timeout):
        last, since = -2, anyio.current_time()
        while True:
            text = (await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{http}/metrics"))[1]
            busy = metric_value(text, "kvbridge_queue_depth") + metric_value(text, "kvbridge_js_in_flight_messages")
            count = await stream_count(cluster.urls)
            now = anyio.current_time()
            if count != last or busy:
                last, since = count, now
            elif now - since > 1.5:
                return
            await anyio.sleep(0.3)


_REPORTED: list[ClusterFigures] = []


def report(fig: ClusterFigures) -> None:
    """Print the CLUSTER line; append it as JSON to KVB_FAULT_REPORT if set."""
    print("\n" + fig.line(), flush=True)
    path = os.environ.get("KVB_FAULT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"cluster": True, **asdict(fig)}) + "\n")
    _REPORTED.append(fig)


def reported() -> list[ClusterFigures]:
    return list(_REPORTED)
