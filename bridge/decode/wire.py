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


class RelayBlockStored(BlockStored, tag="BlockStored"):
    """BlockStored as the bridge relays it in msgpack: `token_ids` kept as the
    publisher's msgpack bytes. The bridge never reads them, and decoding then
    re-encoding every token as a Python int was a third of its work per event.
    The decoder checks that they are an array; consumers decode BlockStored."""

    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # type: ignore[assignment]


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


RelayEvent = Union[RelayBlockStored, BlockRemoved, AllBlocksCleared]


class RelayEventBatch(msgspec.Struct, array_like=True, gc=False):
    """KVEventBatch with stores as RelayBlockStored."""

    ts: float
    events: list[RelayEvent]
    data_parallel_rank: int | None = None


def empty_tokens(stored: type[BlockStored]) -> list[int] | msgspec.Raw:
    """No token ids, in the form `stored` keeps them."""
    return EMPTY_RAW_ARRAY if stored is RelayBlockStored else []


EMPTY_RAW_ARRAY = msgspec.Raw(b"\x90")


class RawEventBatch(msgspec.Struct, array_like=True, gc=False):
    """The same batch with events left undecoded, for the per-event fallback."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None
