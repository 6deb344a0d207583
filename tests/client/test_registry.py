"""The worker registry on a real nats-server's JetStream KV, and the catalog
that fills it from the bridge's own outgoing batches."""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.abc
import msgspec
import nats
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.kv import VALID_KEY_RE

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.client.registry import RegistryFollower, declare_entry
from bridge.contract import GroupInfo, RankInfo, WorkerEntry, decode_entry, liveness, registry_key
from bridge.producer.sink.registry_writer import WorkerRegistry
from bridge.residency.index import ResidencyIndex
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import make_settings, running_bridge
from tests.client.live import wait_until

pytestmark = pytest.mark.anyio


def _entry(worker: str = "pod.a b~", interval: float = 0.1) -> WorkerEntry:
    return WorkerEntry(
        worker=worker, topic="llama", ranks=[RankInfo(0, epoch=5, last_seq=41), RankInfo(1)],
        groups=[GroupInfo(0, "full_attention", "attention", 16), GroupInfo(2, "mamba", "state", 16)],
        started_at=1000.0, heartbeat_interval=interval,
    )


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
def test_registry_keys_are_valid_kv_keys_and_injective(a: str, b: str) -> None:
    assert VALID_KEY_RE.match(registry_key(a))
    assert (registry_key(a) == registry_key(b)) == (a == b)


def test_liveness_from_the_entry_alone() -> None:
    entry = msgspec.structs.replace(_entry(interval=2.0), heartbeat_ts=100.0)
    assert liveness(entry, now=105.9) == "alive"
    assert liveness(entry, now=106.1) == "dead"
    assert liveness(entry, now=106.1, dead_after=4) == "alive"
    assert liveness(msgspec.structs.replace(entry, state="stopped"), now=100.0) == "stopped"


async def test_put_heartbeat_stop_and_follow(nats_server: NatsServerProcess) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        registry = WorkerRegistry(nc.jetstream(), "kv_workers", ttl=30)
        follower = RegistryFollower(nc, "kv_workers", dead_after=3)
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run)
            entry = _entry()
            revision = await registry.put(entry)
            kv = await registry.open()
            got = await kv.get(registry_key(entry.worker))
            assert got.value is not None
            stored = decode_entry(got.value)
            assert got.revision == revision and stored.worker == "pod.a b~" and stored.ranks[0].last_seq == 41
            assert abs(stored.heartbeat_ts - time.time()) < 5
            assert (await kv.status()).ttl == 30

            tg.start_soon(registry.heartbeat, lambda: entry, 0.1)
            await wait_until(lambda: follower.status("pod.a b~") == "alive")
            first = follower.entries["pod.a b~"].heartbeat_ts
            await wait_until(lambda: follower.entries["pod.a b~"].heartbeat_ts > first)
            assert follower.dead() == set()
            assert follower.dead(now=time.time() + 1.0) == {"pod.a b~"}  # 3 × 0.1 s without a beat
            tg.cancel_scope.cancel()
        await registry.stopped(entry)
        async with anyio.create_task_group() as tg:
            again = RegistryFollower(nc, "kv_workers")
            tg.start_soon(again.run)
            await again.loaded.wait()
            assert again.status("pod.a b~") == "stopped" and again.available
            await kv.delete(registry_key("pod.a b~"))
            await wait_until(lambda: "pod.a b~" not in again.entries)
            tg.cancel_scope.cancel()
    finally:
        await nc.close()


async def test_an_existing_bucket_is_used_as_it_is(nats_server: NatsServerProcess) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().create_key_value(bucket="kv_workers", ttl=120)
        registry = WorkerRegistry(nc.jetstream(), "kv_workers", ttl=10)
        await registry.put(_entry())
        assert (await (await registry.open()).status()).ttl == 120
    finally:
        await nc.close()


async def test_follower_without_a_bucket_waits_and_reports_unknown(nats_server: NatsServerProcess) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        follower = RegistryFollower(nc, "nobody_here")
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run)
            with anyio.fail_after(5):
                await follower.loaded.wait()
            assert not follower.available and follower.status("x") is None
            tg.cancel_scope.cancel()
    finally:
        await nc.close()


async def test_catalog_learns_groups_and_seqs_from_real_bridge_traffic(
    nats_server: NatsServerProcess,
) -> None:
    port = free_port()
    publisher = WirePublisher(f"tcp://*:{port}", None)
    settings = make_settings(
        zmq_endpoint=[f"tcp://127.0.0.1:{port}"], nats_url=[nats_server.url], worker_id="pod-r",
        heartbeat_interval=0.1, jetstream=True,
    )
    nc = await nats.connect(nats_server.url)
    index = ResidencyIndex()
    follower = RegistryFollower(nc, "kv_workers", on_entry=lambda e: declare_entry(index, e))
    workload = HybridWorkload(seed=11)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(follower.run)
            async with running_bridge(settings):
                for _ in range(40):
                    publisher.publish(workload.batch(6))
                await wait_until(lambda: _last_seq(follower) == 39)
                assert follower.status("pod-r") == "alive"
            # the bridge's last word before it drained NATS
            await wait_until(lambda: follower.status("pod-r") == "stopped")
            tg.cancel_scope.cancel()
    finally:
        publisher.close()
        await nc.close()
    entry = follower.entries["pod-r"]
    assert entry.topic == "" and entry.subject_prefix == "kv" and entry.heartbeat_interval == 0.1
    assert [(g.group, g.kind, g.family, g.block_size, g.sliding_window) for g in entry.groups] == [
        (0, "full_attention", "attention", 16, None),
        (1, "sliding_window", "window", 16, 128),
        (2, "mamba", "state", 16, None),
    ]
    assert [(r.dp_rank, r.last_seq) for r in entry.ranks] == [(0, 39)] and entry.ranks[0].epoch > 0
    view = index.view("pod-r", 0)
    assert view is not None
    assert {g: r.family for g, r in view.groups.items()} == {0: "attention", 1: "window", 2: "state"}
    assert view.groups[1].window == 128


def _last_seq(follower: RegistryFollower) -> Any:
    entry = follower.entries.get("pod-r")
    return None if entry is None else entry.ranks[0].last_seq
