"""Writes vLLM 0.33.0's KV event wire format byte for byte, without vLLM.

vLLM encodes `KVEventBatch` array-like and each event as a tagged map from a
msgspec Struct with omit_defaults: required fields always present, defaulted
ones only when set. bridge.contract's event structs have vLLM's exact fields,
order and defaults (the bridge's own `placeholder` is omitted while False), so
encoding them gives vLLM's bytes (tests/test_wire_writer.py compares them with
vLLM's own encoder).
"""

from __future__ import annotations

import msgspec

from bridge.contract import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, KVEventBatch

_encode = msgspec.msgpack.Encoder().encode


def stored(
    block_hashes: list[BlockHash],
    parent: BlockHash | None,
    token_ids: list[int],
    block_size: int,
    *,
    medium: str | None = "GPU",
    group_idx: int | None = None,
    kind: str | None = None,
    sliding_window: int | None = None,
    lora_id: int | None = None,
    lora_name: str | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=block_hashes, parent_block_hash=parent, token_ids=token_ids, block_size=block_size,
        lora_id=lora_id, medium=medium, lora_name=lora_name, group_idx=group_idx, kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=sliding_window,
    )


def removed(block_hashes: list[BlockHash], *, medium: str | None = "GPU", group_idx: int | None = None) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=medium, group_idx=group_idx)


def cleared() -> AllBlocksCleared:
    return AllBlocksCleared()


def encode_batch(ts: float, events: list[Event], dp_rank: int | None = None) -> bytes:
    return _encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=dp_rank))
