"""Writes vLLM 0.33.0's KV event wire format byte for byte, without vLLM.

vLLM encodes `KVEventBatch` array-like and each event as a tagged map from a
msgspec Struct with omit_defaults: required fields always present, defaulted
ones only when set, map headers sized the way msgspec sizes them. Publish-side
structs with vLLM's exact field order and defaults give the same bytes
(tests/test_wire_writer.py compares them with vLLM's own encoder).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from bridge.decode.wire import BlockHash


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


WireEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


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


def encode_batch(ts: float, events: list[WireEvent], dp_rank: int | None = None) -> bytes:
    return _encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=dp_rank))
