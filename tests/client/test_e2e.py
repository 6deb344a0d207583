"""vLLM's own ZmqEventPublisher → the bridge → a real nats-server → bridge.client's index."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.apps.demo.wire_writer import encode_batch
from bridge.apps.demo.wire_writer import stored as wire_stored
from bridge.contract import BlockHash
from bridge.residency.index import ResidencyIndex
from bridge.runtime.nats_server import NatsServerProcess
from bridge.runtime.ports import free_port
from tests.busutil import make_settings, running_bridge
from tests.client.builders import hb, hi
from tests.client.live import live_index, wait_until

kv_events = pytest.importorskip("vllm.distributed.kv_events")

pytestmark = pytest.mark.anyio

B = 16
WINDOW = 64  # vLLM needs ceil(63 / 16) = 4 window blocks before a hit


def _store(hashes: list, group: int, kind: str, medium: str = "GPU", window: int | None = None):
    return kv_events.BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=list(range(B * len(hashes))), block_size=B,
        lora_id=None, medium=medium, lora_name=None, group_idx=group, kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def _remove(hashes: list, group: int, medium: str = "GPU"):
    return kv_events.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


def _seen(index: ResidencyIndex, worker: str, seq: int) -> Callable[[], bool]:
    def check() -> bool:
        view = index.view(worker, 0)
        return view is not None and view.last_seq == seq

    return check


def _attention_batch(hashes: list[BlockHash]) -> bytes:
    return encode_batch(time.time(), [wire_stored(hashes, None, [], B, group_idx=0, kind="full_attention")])


@pytest.mark.parametrize("fmt,form", [("msgpack", "bytes"), ("json", "int")])
async def test_hybrid_prefix_from_vllm_publisher_through_bridge_and_nats(
    nats_server: NatsServerProcess, fmt: str, form: str
) -> None:
    h = [hb(i) if form == "bytes" else hi(i) for i in range(8)]
    chain = [hb(i) for i in range(8)]  # the router computes bytes; int-published blocks still match
    port, replay_port = free_port(), free_port()
    publisher = kv_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}"
    )
    settings = make_settings(
        zmq_endpoint=[f"tcp://127.0.0.1:{port}"], replay_endpoint=[f"tcp://127.0.0.1:{replay_port}"],
        nats_url=[nats_server.url], format=fmt, worker_id="pod-a",
    )
    steps = [
        # attention 0..7, window 0..7, checkpoints after block 3 (GPU) and block 7 (CPU only)
        ([_store(h, 0, "full_attention"), _store(h, 1, "sliding_window", window=WINDOW),
          _store([h[3]], 2, "mamba"), _store([h[7]], 2, "mamba", medium="CPU"),
          # a second request shares the first blocks: vLLM announces them again
          _store(h[:2], 0, "full_attention")],
         {None: 8, "GPU": 4}),
        # the window slides: blocks 0..3 leave it; p=4 now lacks its window, p=8 still has it
        ([_remove(h[:4], 1)], {None: 8, "GPU": 0}),
        # the CPU checkpoint goes; removing a state hash leaves attention alone
        ([_remove([h[7]], 2, medium="CPU")], {None: 0, "GPU": 0}),
        ([_store([h[7]], 2, "mamba")], {None: 8, "GPU": 8}),
        # one copy of block 1 goes, the re-announced one stays
        ([_remove([h[1]], 0)], {None: 8, "GPU": 8}),
        ([_remove([h[1]], 0)], {None: 0, "GPU": 0}),
    ]
    try:
        async with live_index(nats_server.url) as index, running_bridge(settings):
            for seq, (events, want) in enumerate(steps):
                publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=events))
                await wait_until(_seen(index, "pod-a", seq))
                for medium, blocks in want.items():
                    media = None if medium is None else {medium}
                    got = [(m.worker, m.blocks) for m in index.longest_prefix(chain, media=media)]
                    assert got == [("pod-a", blocks)], (seq, medium)
            view = index.view("pod-a", 0)
            assert view is not None
            assert {g: r.family for g, r in view.groups.items()} == {0: "attention", 1: "window", 2: "state"}
            assert view.groups[1].window == WINDOW and view.groups[0].block_size == B
            assert not view.stale and view.gaps == 0
    finally:
        publisher.shutdown()


async def test_a_gap_on_the_bus_makes_the_worker_stale(nats_server: NatsServerProcess) -> None:
    """No replay endpoint: a lost batch becomes a gap record, and the index stops
    trusting what it held before it."""
    port = free_port()
    publisher = WirePublisher(f"tcp://*:{port}", None)
    settings = make_settings(zmq_endpoint=[f"tcp://127.0.0.1:{port}"], nats_url=[nats_server.url], worker_id="pod-b")
    before: list[BlockHash] = [hb(i) for i in range(4)]
    after: list[BlockHash] = [hb(i) for i in range(10, 12)]
    try:
        async with live_index(nats_server.url) as index, running_bridge(settings):
            publisher.publish(_attention_batch(before))
            await wait_until(_seen(index, "pod-b", 0))
            assert index.longest_prefix(before)[0].blocks == 4
            publisher.publish(b"lost", drop=True)
            publisher.publish(_attention_batch(after))
            await wait_until(_seen(index, "pod-b", 2))
            view = index.view("pod-b", 0)
            assert view is not None and view.gaps == 1 and view.lost == [(1, 1)] and view.stale
            [match] = index.longest_prefix(before)
            assert match.stale and match.blocks == 0
            assert index.longest_prefix(before, include_suspect=True)[0].blocks == 4
            assert index.longest_prefix(after)[0].blocks == 2  # announced after the gap: trusted
    finally:
        publisher.close()
