"""vLLM's own ZmqEventPublisher → the bridge → a real nats-server → a subscriber."""

from __future__ import annotations

import time
from typing import cast

import anyio
import pytest

from bridge.contract import BlockRemoved as WireRemoved
from bridge.contract import BlockStored as WireStored
from bridge.contract import GroupMessage, WorkerRecord
from bridge.producer.telemetry.metrics import MALFORMED_REASONS
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import BusCollector, make_settings, metric, running_bridge

kv_events = pytest.importorskip("vllm.distributed.kv_events")

pytestmark = pytest.mark.anyio


def _hybrid_batches(n: int) -> list:
    """n vLLM batches of a hybrid model: attention (g0), window (g1), mamba (g2),
    with evictions, a legacy event and a clear; bytes hashes."""
    B = kv_events
    batches = []
    for i in range(n):
        h = [bytes([i, k]) * 16 for k in range(4)]
        events = [
            B.BlockStored(block_hashes=h, parent_block_hash=None, token_ids=list(range(64)), block_size=16,
                          lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
            B.BlockStored(block_hashes=h[-2:], parent_block_hash=h[1], token_ids=list(range(32)), block_size=16,
                          lora_id=None, medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window",
                          kv_cache_spec_sliding_window=32),
            B.BlockStored(block_hashes=[h[-1]], parent_block_hash=h[-2], token_ids=[], block_size=16,
                          lora_id=None, medium="CPU", lora_name=None, group_idx=2, kv_cache_spec_kind="mamba"),
            # an unpatched offload tier's mamba store: several hashes, reduced to the last
            B.BlockStored(block_hashes=h, parent_block_hash=None, token_ids=[], block_size=16,
                          lora_id=None, medium="STORAGE", lora_name=None, group_idx=2, kv_cache_spec_kind="mamba"),
            # a window placeholder from the offload tier: dropped by default
            B.BlockStored(block_hashes=[h[-1]], parent_block_hash=None, token_ids=[], block_size=0,
                          lora_id=None, medium="CPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window"),
        ]
        if i % 3 == 2:
            events.append(B.BlockRemoved(block_hashes=h[:2], medium="GPU", group_idx=0))
            events.append(B.BlockRemoved(block_hashes=[h[-1]], medium="CPU", group_idx=2))
        if i == n - 1:
            events.append(B.AllBlocksCleared())
        batches.append(B.KVEventBatch(ts=time.time(), events=events))
    return batches


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_every_vllm_event_arrives_once_in_order_on_its_subject(nats_server: NatsServerProcess, fmt: str) -> None:
    port, replay_port = free_port(), free_port()
    publisher = kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv"
    )
    settings = make_settings(
        zmq_endpoint=[f"tcp://127.0.0.1:{port}"], replay_endpoint=[f"tcp://127.0.0.1:{replay_port}"],
        nats_url=[nats_server.url], topic="kv", format=fmt, worker_id="pod.a b*>", prompt_data="relay",
    )
    bus = await BusCollector(fmt).start(nats_server.url)
    batches = _hybrid_batches(12)
    try:
        async with running_bridge(settings) as bridge:
            for batch in batches:
                publisher.publish(batch)
            await bus.wait_for(lambda b: len(b.records("cleared")) == 1)
            await anyio.sleep(0.2)
            for reason in MALFORMED_REASONS:
                assert metric(bridge, "kvbridge_malformed_total", reason=reason) == 0
            assert metric(bridge, "kvbridge_dropped_total", reason="window_placeholder") == 12
            assert metric(bridge, "kvbridge_transformed_total", what="state_reduced") == 12
    finally:
        publisher.shutdown()
        await bus.close()

    worker_token = "pod~2Ea~20b~2A~3E"
    assert bus.wrong_format == [], f"payloads not in {fmt}"
    groups = bus.groups()
    # every batch once, in order, none twice (seq per batch, one message per group)
    assert bus.seqs() == list(range(12))
    seen = [(g.seq, g.group) for g in groups]
    assert len(seen) == len(set(seen))
    for received in bus.items:
        body = received.body
        if received.subject.endswith(".worker"):
            assert received.subject == f"kv.{worker_token}.worker"
            continue
        assert isinstance(body, GroupMessage)
        assert received.subject == f"kv.{worker_token}.{body.group}"
        assert body.worker == "pod.a b*>" and body.dp_rank == 0 and body.topic == "kv"
        assert {0: "attention", 1: "window", 2: "state"}[body.group] == body.family
        assert received.headers["Kvb-Family"] == body.family
        assert received.headers["Nats-Msg-Id"] == f"{worker_token}:0:{body.epoch}:{body.seq}:{body.group}"

    for i, batch in enumerate(batches):
        mine = {g.group: g for g in groups if g.seq == i}
        sent = batch.events
        attention = mine[0].events
        assert [e.block_hashes for e in attention] == [sent[0].block_hashes] + (
            [sent[5].block_hashes] if i % 3 == 2 else []
        )
        assert isinstance(attention[0], WireStored) and attention[0].token_ids == list(range(64))
        # window: the real store passes, the placeholder is dropped
        assert [e.block_hashes for e in mine[1].events] == [sent[1].block_hashes]
        # state: the checkpoint as sent, and the multi-hash store reduced to its last hash + parent
        state = mine[2].events
        assert state[0].block_hashes == sent[2].block_hashes
        assert state[1].block_hashes == [sent[3].block_hashes[-1]]
        assert isinstance(state[1], WireStored)
        assert state[1].parent_block_hash == sent[3].block_hashes[-2] and state[1].token_ids == []
        if i % 3 == 2:
            assert isinstance(state[2], WireRemoved) and state[2].block_hashes == sent[6].block_hashes
    cleared = bus.records("cleared")[0]
    assert cleared.seq == 11
    # the clear comes after the last batch's group messages and before the stop record
    order = [(cast(WorkerRecord, r.body).type if r.subject.endswith(".worker") else "group") for r in bus.items]
    assert order.index("cleared") > max(i for i, o in enumerate(order) if o == "group")
    assert order[0] == "start" and order[-1] == "stop"


async def test_int_hashes_and_legacy_events_pass_through(nats_server: NatsServerProcess) -> None:
    B = kv_events
    port = free_port()
    publisher = B.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{port}")
    settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{port}"], nats_url=[nats_server.url])
    bus = await BusCollector().start(nats_server.url)
    try:
        async with running_bridge(settings):
            publisher.publish(B.KVEventBatch(ts=time.time(), events=[
                # legacy vLLM: no group, no kind
                B.BlockStored(block_hashes=[2**63 + 5, 7], parent_block_hash=3, token_ids=[1, 2], block_size=1,
                              lora_id=None, medium="GPU", lora_name=None),
                B.BlockRemoved(block_hashes=[7], medium="GPU"),
            ]))
            await bus.wait_for(lambda b: len(b.groups()) == 1)
    finally:
        publisher.shutdown()
        await bus.close()
    msg = bus.groups()[0]
    assert (msg.group, msg.kind, msg.family, msg.kind_source) == (0, "full_attention", "attention", "legacy")
    assert isinstance(msg.events[0], WireStored)
    assert msg.events[0].block_hashes == [2**63 + 5, 7] and msg.events[0].parent_block_hash == 3
    assert msg.events[1].block_hashes == [7]
