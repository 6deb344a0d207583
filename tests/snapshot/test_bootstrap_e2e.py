"""A consumer that starts late, against a real bridge and nats-server: after
bootstrapping it holds what a consumer that watched from the start holds."""

from __future__ import annotations

import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.workload import HybridWorkload
from bridge.client.bootstrap import BootstrapOptions
from bridge.client.subscribe import StartAt
from bridge.residency import ResidencyIndex
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import endpoints, make_settings, running_bridge
from tests.client.live import live_index, wait_until
from tests.snapshot.rig import late_index
from tests.snapshot.views import index_state

pytestmark = pytest.mark.anyio


def _caught_up(index: ResidencyIndex, seq: int) -> bool:
    view = index.view("pod-s", 0)
    return view is not None and view.last_seq == seq


@pytest.mark.parametrize("jetstream", [False, True])
async def test_a_late_consumer_bootstraps_to_the_watchers_view(nats_server: NatsServerProcess,
                                                               jetstream: bool) -> None:
    pub_ep, replay_ep = endpoints()
    publisher = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    work = HybridWorkload(seed=3, engine_shapes=True)
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             worker_id="pod-s", jetstream=jetstream)
    try:
        async with running_bridge(settings), live_index(nats_server.url) as watcher:
            for i in range(60):
                publisher.publish(work.batch(12, clear=(i == 20)))
            await wait_until(lambda: _caught_up(watcher, 59), 20)
            since = StartAt("snapshot") if jetstream else None
            boot = None if jetstream else BootstrapOptions()
            async with late_index(nats_server.url, since=since, bootstrap=boot) as (late, sub):
                for _ in range(40):
                    publisher.publish(work.batch(12))
                await wait_until(lambda: _caught_up(watcher, 99) and _caught_up(late, 99), 20)
                assert [s.source for s in sub.sources] == ["service"]
                state = index_state(watcher)
                assert state[("pod-s", 0)]["groups"][0][5]["GPU"][0], "the attention group holds blocks"
                assert index_state(late) == state
                assert not late.view("pod-s", 0).stale  # type: ignore[union-attr]
    finally:
        publisher.close()
