"""The keeper applies the contract messages the sink encoded, not their payloads
decoded again, and holds the same residency a consumer decodes from the wire.

Real vLLM-shaped batches (the demo's hybrid workload: attention, window and
mamba groups, evictions, offload placeholders, clears) go through the
bridge's own decoder, normalizer and framing; one keeper is handed the
messages with their bodies (what a bridge with snapshots does), another the
same messages without (it decodes each payload), and a consumer decodes every
payload as it would off NATS."""

from __future__ import annotations

import gc
import tracemalloc

import msgspec
import structlog

from bridge.apps.demo.wire_writer import encode_batch, stored
from bridge.apps.demo.workload import ATTN, BLOCK_SIZE, MAMBA, WINDOW, WINDOW_TOKENS, HybridWorkload
from bridge.contract import HDR_RECORD, BlockStored, GroupMessage, WorkerRecord, decoder_for
from bridge.contract.snapshot import RankSnapshot
from bridge.producer.decode.decoder import BatchDecoder
from bridge.producer.normalize.normalizer import KindBook, Normalizer, NormalizeStats, StreamIdentity
from bridge.producer.sink.encode import MessageEncoder, Outgoing
from bridge.producer.sink.framing import Framing
from bridge.producer.sink.queue import BatchQueue, OutBatch
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.producer.telemetry.metrics import Metrics
from bridge.residency import ResidencyIndex
from bridge.residency.rank_tables import RankTables

WORKER = "pod-bodies"


def _batches(size: int, count: int, seed: int = 3) -> list[bytes]:
    """`count` vLLM batches of about `size` events with a clear in the
    middle, then one request that leaves a checkpoint in every group, then
    report mode "full": vLLM announcing that request's prefix again
    (parent-less and with its tokens, in every group)."""
    workload = HybridWorkload(seed=seed, engine_shapes=True)
    out = [workload.batch(size, clear=i == count // 2) for i in range(count)]
    request = HybridWorkload(seed=seed + 1).request_events(12)  # a checkpoint in every group
    out.append(encode_batch(0.0, request))
    first = request[0]
    assert isinstance(first, BlockStored)
    chain = first.block_hashes
    tokens = list(range(len(chain) * BLOCK_SIZE))
    recent = WINDOW_TOKENS // BLOCK_SIZE
    out.append(encode_batch(0.0, [
        stored(chain, None, tokens, BLOCK_SIZE, group_idx=ATTN, kind="full_attention"),
        stored(chain[-recent:], None, tokens, BLOCK_SIZE, group_idx=WINDOW, kind="sliding_window",
               sliding_window=WINDOW_TOKENS),
        stored([chain[-1]], None, tokens, BLOCK_SIZE, group_idx=MAMBA, kind="mamba"),
    ]))
    return out


def _messages(batches: list[bytes], keep_bodies: bool) -> list[Outgoing]:
    """The messages the bridge publishes for `batches`, in order."""
    ident = StreamIdentity(worker=WORKER, dp_rank=0, topic="", epoch=5)
    encoder = MessageEncoder("msgpack", keep_bodies=keep_bodies)
    framing = Framing(0, ident, SubjectBook("kv", WORKER, 0), encoder, lambda: 1 << 20, Metrics(),
                      structlog.get_logger("test"), clock=lambda: 1000.0)
    decoder, normalizer, stats = BatchDecoder(relay=True), Normalizer(KindBook({}), False), NormalizeStats()
    out: list[Outgoing] = [framing.record("start", reason="fresh").messages[0]]
    for seq, payload in enumerate(batches):
        batch = decoder.decode(payload)
        items = normalizer.normalize(ident, seq, batch.ts, batch.events, 0.0, stats)
        out.extend(framing.batch(seq, batch.ts, items)[0].messages)
    return out


def _kept(messages: list[Outgoing]) -> tuple[ResidencyKeeper, RankSnapshot]:
    keeper = ResidencyKeeper(WORKER, ranks=(0,))
    keeper.published(messages)
    keeper.catch_up()
    snap = keeper.snapshot(0)
    assert snap is not None
    return keeper, snap


def _consumer(messages: list[Outgoing]) -> ResidencyIndex:
    """A consumer's index, from each payload as NATS delivers it."""
    index = ResidencyIndex(store=RankTables())
    groups, records = decoder_for("msgpack", GroupMessage), decoder_for("msgpack", WorkerRecord)
    for m in messages:
        index.apply((records if HDR_RECORD in m.headers else groups).decode(m.payload))
    return index


def test_the_keeper_holds_what_consumers_decode_from_the_same_messages() -> None:
    batches = _batches(64, 60)
    with_bodies, without = _messages(batches, True), _messages(batches, False)
    assert all(m.body is not None for m in with_bodies) and all(m.body is None for m in without)
    assert [m.payload for m in with_bodies] == [m.payload for m in without]

    keeper, snap = _kept(with_bodies)
    decoding, decoded = _kept(without)
    consumer = _consumer(without).snapshot(WORKER, 0, through=snap.through, now=snap.taken_at)
    # The rule that reads token ids (report mode "full") ran on the bodies' raw token ids.
    assert keeper.index.reannounced_ignored > 0
    assert keeper.index.reannounced_ignored == decoding.index.reannounced_ignored
    assert snap.groups and any(t.trusted for g in snap.groups for t in g.tiers)
    assert msgspec.structs.replace(decoded, taken_at=snap.taken_at) == snap
    assert consumer is not None
    assert msgspec.structs.replace(consumer, stream_seq=snap.stream_seq) == snap


def test_the_log_bound_is_the_memory_the_log_holds() -> None:
    """--snapshot-log-bytes bounds memory: what the log counts for the
    messages it holds is what tracemalloc finds them holding."""
    for size, count in ((8, 600), (64, 80), (512, 12)):
        batches = _batches(size, count, seed=size)
        keeper = ResidencyKeeper(WORKER, max_log_bytes=1 << 40, ranks=(0,))
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for m in _messages(batches, True):
                keeper.published([m])
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert 0.85 < keeper.log_bytes / held < 1.15, (size, keeper.log_bytes, held)


def test_a_queue_counts_the_bodies_its_batches_carry_and_writes_by_wire_bytes() -> None:
    messages = _messages(_batches(64, 4), True)
    wire = sum(len(m.payload) + len(m.head) for m in messages)
    assert all(m.kept > len(m.payload) for m in messages if m.events)
    queue = BatchQueue(100, lambda lost: OutBatch(0, 0, -1, 0.0, []), max_bytes=1 << 30)
    batch = OutBatch(0, 5, 0, 0.0, messages)
    queue.put(batch)
    assert queue.bytes == wire + sum(m.kept for m in messages)
    assert batch.nbytes == wire  # what the publisher sizes its writes by
