"""msgspec mirrors of vLLM 0.33.0's KV event wire structs.

They are written from the wire facts (DESIGN.md §1), not imported from vLLM, so the
bridge runs without vLLM installed. Decoding ignores unknown map keys and extra
array elements, so newer vLLM releases keep decoding.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

# vLLM sends raw bytes hashes by default and 64-bit ints with
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1; both travel on.
BlockHash = Union[bytes, int]


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None
    # Never set by vLLM: the bridge marks window placeholders it forwards with
    # --keep-placeholders (block_size=0, one hash, no position).
    placeholder: bool = False


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class RawEventBatch(msgspec.Struct, array_like=True, gc=False):
    """The same batch with events left undecoded, for the per-event fallback."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None
