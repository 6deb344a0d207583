"""Writes vLLM 0.33.0's KV event wire format byte for byte, without vLLM.

vLLM encodes `KVEventBatch` array-like and each event as a tagged map whose
keys follow the struct's field order, required fields always present and
defaulted ones only when set. These builders keep that order, so the bytes
equal vLLM's own (tests/test_wire_writer.py compares them with vLLM's encoder).
"""

from __future__ import annotations

from typing import Any

import msgspec

from bridge.decode.wire import BlockHash

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
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": block_hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
    }
    if group_idx is not None:
        event["group_idx"] = group_idx
    if kind is not None:
        event["kv_cache_spec_kind"] = kind
    if sliding_window is not None:
        event["kv_cache_spec_sliding_window"] = sliding_window
    return event


def removed(block_hashes: list[BlockHash], *, medium: str | None = "GPU", group_idx: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium}
    if group_idx is not None:
        event["group_idx"] = group_idx
    return event


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[dict[str, Any]], dp_rank: int | None = None) -> bytes:
    batch: list[Any] = [ts, events]
    if dp_rank is not None:
        batch.append(dp_rank)
    return _encode(batch)
