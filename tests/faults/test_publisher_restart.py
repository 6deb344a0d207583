"""vLLM's own publisher (ZmqEventPublisher) goes away and a new process takes
its endpoints: seq starts over at 0, the bridge opens a new epoch, says
`restart`, and loses nothing of either process."""

from __future__ import annotations

import socket
import time

import anyio
import pytest

from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import endpoints, make_settings, metric, running_bridge, wait_published
from tests.faults.harness import (
    ATTN_GROUP,
    STATE_GROUP,
    LiveBus,
    account,
    ident,
    report,
    soak,
)

pytestmark = pytest.mark.anyio


def _vllm_batch(kv, pub: int, k: int):
    h = ident(pub, k)
    return kv.KVEventBatch(ts=time.time(), events=[
        kv.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                       lora_id=None, medium="GPU", lora_name=None, group_idx=ATTN_GROUP,
                       kv_cache_spec_kind="full_attention"),
        kv.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=STATE_GROUP, kv_cache_spec_kind="mamba"),
    ])


def _port_free(endpoint: str) -> bool:
    port = int(endpoint.rsplit(":", 1)[1])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


async def _new_publisher(kv, bind: dict[str, str]):
    """A new process binds the old one's ports; ZMQ releases them a moment
    after close (its I/O thread), so wait for both, as a restarting pod would."""
    with anyio.fail_after(10):
        while not all(_port_free(ep) for ep in bind.values()):
            await anyio.sleep(0.05)
    return kv.ZmqEventPublisher(0, **bind)


async def test_vllm_publisher_restart(nats_server: NatsServerProcess) -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    pub_ep, replay_ep = endpoints()
    bind = {"endpoint": pub_ep.replace("127.0.0.1", "*"), "replay_endpoint": replay_ep.replace("127.0.0.1", "*")}
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url])
    bus = await LiveBus().start(nats_server.url)
    rounds = 4 if soak() else 1
    first_n, next_n = 100, 60
    sent: dict[int, int] = {}
    try:
        async with running_bridge(settings) as bridge:
            publisher = kv.ZmqEventPublisher(0, **bind)
            # no wait for the SUB to connect: what the slow joiner misses, replay
            # heals as soon as a later batch arrives live
            for k in range(first_n):
                publisher.publish(_vllm_batch(kv, 0, k))
                await anyio.sleep(0.01)
            sent[0] = first_n
            await wait_published(bridge, first_n)
            total = first_n
            for r in range(1, rounds + 1):
                publisher.shutdown()
                # a new process on the same endpoints, publishing at once: the
                # bridge first sees whatever live seq its SUB reconnects to
                publisher = await _new_publisher(kv, bind)
                for k in range(next_n):
                    publisher.publish(_vllm_batch(kv, r, k))
                    await anyio.sleep(0.02)
                sent[r] = next_n
                total += next_n
                await wait_published(bridge, total)
            publisher.shutdown()
            restarts = metric(bridge, "kvbridge_restarts_total")
            replayed = metric(bridge, "kvbridge_replayed_batches_total")
        await bus.wait_records("stop")
    finally:
        await bus.close()
    fig = account("vllm_publisher_restart", sent, bus.items,
                  notes=f"restarts_metric={restarts:.0f} replayed={replayed:.0f}")
    report(fig)
    assert fig.lost == 0 and fig.duplicated == 0
    assert fig.restarts == rounds and fig.epochs == rounds + 1 and fig.gap_records == 0
    assert fig.out_of_order == 0 and fig.wrong_seq == 0
    # each restart record comes before the first batch of its epoch
    from bridge.contract import GroupMessage, WorkerRecord

    seen_epochs: set[int] = set()
    announced_epochs: set[int] = set()
    for _, body in bus.items:
        if isinstance(body, WorkerRecord) and body.type == "restart":
            announced_epochs.add(body.epoch)
        elif isinstance(body, GroupMessage) and body.epoch not in seen_epochs:
            assert not seen_epochs or body.epoch in announced_epochs, "a new epoch without its restart record first"
            seen_epochs.add(body.epoch)
