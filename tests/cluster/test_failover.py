"""Failover on a three-server cluster with an R3 stream, while vLLM keeps
publishing (1 500 batches at about 200/s, two group messages each): every
batch in the stream exactly once (by Nats-Msg-Id), in order per worker and
rank or named by a gap, and a core subscriber on a server the fault spares
sees every batch or a gap naming it. Each test prints a `CLUSTER` line; the
run ends with the table (docs/operations.md, "On a cluster")."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.cluster.harness import ClusterFigures, NatsCluster
from tests.cluster.scenario import Fault, Roles, run_fault

pytestmark = pytest.mark.anyio

TOTAL, FAULT_AT, HEAL_AT = 1500, 300, 1000


def _assert_sound(fig: ClusterFigures) -> None:
    assert fig.copies == 0, "a message stored twice"
    assert fig.wrong_seq == 0
    assert fig.late_unannounced == 0, "batches stored after later ones, named by no gap"
    assert fig.lost_unannounced == 0, "batches missing from the stream, named by no gap"
    assert fig.live_missing_unannounced == 0, "the core subscriber missed batches no gap names"


async def _kill(roles: Roles) -> None:
    assert roles.target is not None
    roles.target.kill9()


async def _restart(roles: Roles) -> None:
    assert roles.target is not None
    await anyio.to_thread.run_sync(roles.target.start)


async def _freeze(roles: Roles) -> None:
    assert roles.target is not None
    roles.target.freeze()


async def _thaw(roles: Roles) -> None:
    assert roles.target is not None
    roles.target.thaw()


async def _step_down(roles: Roles) -> None:
    await roles.cluster.step_down("KV_EVENTS")


async def test_kill9_of_the_server_the_bridge_is_connected_to(cluster: NatsCluster, tmp_path: Path) -> None:
    """The bridge's server dies (not the stream's leader) with messages in
    flight: frozen for 0.3 s first, so its socket holds unacked publishes,
    then SIGKILL. The bridge reconnects to another server and sends what was
    unacked again, oldest first."""
    fault = Fault("cluster_kill9_connected_server", lambda r: r.connected, _freeze, _restart, separate=True,
                  then=((FAULT_AT + 60, _kill),))
    fig, _, _ = await run_fault(cluster, tmp_path, fault, total=TOTAL, fault_at=FAULT_AT, heal_at=HEAL_AT)
    _assert_sound(fig)
    assert fig.lost == 0 and fig.late == 0


async def test_kill9_of_the_stream_leader(cluster: NatsCluster, tmp_path: Path) -> None:
    """No leader for seconds (nats-server waits 4-9 s to elect one): no ack
    comes, the bridge stops sending newer messages within a second, tries the
    oldest until the new leader stores it, then the rest in order."""
    fault = Fault("cluster_kill9_stream_leader", lambda r: r.leader, _kill, _restart, separate=True)
    fig, _, _ = await run_fault(cluster, tmp_path, fault, total=TOTAL, fault_at=FAULT_AT, heal_at=HEAL_AT)
    _assert_sound(fig)
    assert fig.lost == 0 and fig.late == 0


async def test_graceful_leader_stepdown(cluster: NatsCluster, tmp_path: Path) -> None:
    """A new leader within milliseconds: the few messages in flight to the old
    one are sent again behind what the new one already stored. Those batches
    are named by a gap (reordered); nothing is lost, nothing stored twice."""
    fault = Fault("cluster_leader_stepdown", lambda r: r.leader, _step_down)
    fig, _, _ = await run_fault(cluster, tmp_path, fault, total=TOTAL, fault_at=FAULT_AT, heal_at=HEAL_AT)
    _assert_sound(fig)
    assert fig.lost == 0


async def test_sigstop_of_the_connected_server_past_the_buffer_bound(cluster: NatsCluster, tmp_path: Path) -> None:
    """The bridge's server frozen for 6 s (and its stream leader moved away
    first): the bridge sees no ack, then no PONG, drops that connection for
    another server. With --max-buffered-batches 100 (half a second) the queue
    sheds its oldest meanwhile: every batch lost is named (queue_overflow),
    the rest stored once, in order. Then the server thaws and rejoins."""
    fault = Fault("cluster_sigstop_connected_past_buffer", lambda r: r.connected, _freeze, _thaw,
                  separate=True, bridge_args=["--max-buffered-batches", "100"])
    fig, _, _ = await run_fault(cluster, tmp_path, fault, total=TOTAL, fault_at=FAULT_AT,
                                heal_at=FAULT_AT + 1200)
    _assert_sound(fig)
    assert fig.lost > 0, "the freeze did not outlast the buffer: the test proves nothing"
    assert fig.gaps.get("queue_overflow", 0) >= 1
