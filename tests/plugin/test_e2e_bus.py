"""The whole way: patched tracker → vLLM's ZmqEventPublisher → the bridge → NATS.

The mamba group's offloaded checkpoints arrive in family `state` on their
group's subject, each at the hash its attention chunk ends with."""

from __future__ import annotations

import time
from typing import cast

import anyio
import pytest

from bridge.contract import BlockStored, GroupMessage
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import BusCollector, make_settings, running_bridge
from tests.plugin.hybrid import ATTENTION, MAMBA, WINDOW, patched_events

kv_events = pytest.importorskip("vllm.distributed.kv_events")

pytestmark = pytest.mark.anyio


async def test_patched_mamba_checkpoints_reach_the_bus_as_state(nats_server: NatsServerProcess, hash_mode: str) -> None:
    run = patched_events(3)
    port, rport = free_port(), free_port()
    publisher = kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{port}"], replay_endpoint=[f"tcp://127.0.0.1:{rport}"],
                             nats_url=[nats_server.url], worker_id="gpu-0")
    bus = await BusCollector().start(nats_server.url)
    try:
        async with running_bridge(settings):
            await anyio.sleep(0.3)
            publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=run.events))
            await bus.wait_for(lambda b: {g.group for g in b.groups()} >= {ATTENTION, MAMBA})
            await anyio.sleep(0.2)
    finally:
        publisher.shutdown()
        await bus.close()
    by_group = {g.group: g for g in bus.groups()}
    subjects = {cast(GroupMessage, r.body).group: r.subject for r in bus.items if not r.subject.endswith(".worker")}
    assert subjects[MAMBA] == f"kv.gpu-0.{MAMBA}"
    state, attention = by_group[MAMBA], by_group[ATTENTION]
    assert (state.family, state.kind, state.kind_source) == ("state", "mamba", "event")
    assert attention.family == "attention"
    assert len(state.events) == len(attention.events) == run.num_chunks
    for checkpoint, chunk in zip(state.events, attention.events):
        assert isinstance(checkpoint, BlockStored) and isinstance(chunk, BlockStored)
        assert checkpoint.block_hashes == [chunk.block_hashes[-1]]
        assert checkpoint.token_ids == [] and checkpoint.block_size == chunk.block_size > 0
        assert checkpoint.medium == "CPU"
        before = chunk.block_hashes[-2] if len(chunk.block_hashes) > 1 else chunk.parent_block_hash
        assert checkpoint.parent_block_hash == before
        expected_type = bytes if hash_mode == "bytes" else int
        assert isinstance(checkpoint.block_hashes[0], expected_type)
    # the window group's offload placeholders carry no position: dropped by default; the
    # group's first slice goes out as its shape store, naming nothing
    assert [e.block_hashes for e in by_group[WINDOW].events] == [[]]
    assert by_group[WINDOW].family == "window"
