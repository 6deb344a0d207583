"""A JetStream-mode bridge restarted: its residency rebuilt from the bucket
and the stream, or from the stream alone, and marked partial when the stream
no longer holds what it needs."""

from __future__ import annotations

import nats
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import endpoints, make_settings, running_bridge, wait_published
from tests.client.live import live_index, wait_until
from tests.snapshot.views import view_state

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("bucket", ["kv_snapshots", ""])
async def test_a_restarted_bridge_knows_what_it_published(nats_server: NatsServerProcess, bucket: str) -> None:
    pub_ep, replay_ep = endpoints()
    publisher = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    work = HybridWorkload(seed=5, engine_shapes=True)
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             worker_id="pod-r", jetstream=True, snapshot_bucket=bucket)
    try:
        async with live_index(nats_server.url) as watcher:
            async with running_bridge(settings) as bridge:
                for _ in range(30):
                    publisher.publish(work.batch(10))
                await wait_published(bridge, 30)
            async with running_bridge(settings) as bridge:
                for _ in range(10):
                    publisher.publish(work.batch(10))
                await wait_published(bridge, 10)
                await wait_until(lambda: watcher.view("pod-r", 0) is not None
                                 and watcher.view("pod-r", 0).last_seq == 39)  # type: ignore[union-attr]
                keeper = bridge.keeper
                assert keeper is not None
                keeper.catch_up()
                mine = keeper.index.view("pod-r", 0)
                assert mine is not None and not mine.partial
                assert view_state(mine) == view_state(watcher.view("pod-r", 0))  # type: ignore[arg-type]
    finally:
        publisher.close()


async def test_a_stream_that_lost_the_ranks_past_leaves_the_rebuilt_view_partial(
    nats_server: NatsServerProcess,
) -> None:
    pub_ep, replay_ep = endpoints()
    publisher = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    work = HybridWorkload(seed=6, engine_shapes=True)
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             worker_id="pod-p", jetstream=True, snapshot_bucket="")
    try:
        async with running_bridge(settings) as bridge:
            for _ in range(20):
                publisher.publish(work.batch(10))
            await wait_published(bridge, 20)
        nc = await nats.connect(nats_server.url)
        await nc.jetstream().purge_stream("KV_EVENTS", keep=5)  # the epoch's start is gone
        await nc.close()
        async with running_bridge(settings) as bridge:
            keeper = bridge.keeper
            assert keeper is not None
            keeper.catch_up()
            view = keeper.index.view("pod-p", 0)
            assert view is not None and view.partial and view.stale
            snap = keeper.snapshot(0)
            assert snap is not None and not snap.complete
    finally:
        publisher.close()
