"""vLLM's KV event structs, as vLLM publishes them and as the bridge relays them.

They are written from the wire facts (docs/compatibility.md), not imported from
vLLM, so neither the bridge nor a consumer needs vLLM installed. Decoding
ignores unknown map keys, so newer vLLM releases keep decoding. These are the
tagged-map forms (vLLM 0.24.0 and later); the bridge turns every older
encoding into them (bridge.producer.decode), and relays them with vLLM's required fields
required, so vLLM's own structs decode every relayed event.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, Union

import msgspec

# 64-bit ints (vLLM's default; Python hash() ints, possibly negative, before
# 0.10.2) or raw 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0); both travel on.
BlockHash = Union[bytes, int]


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    # The fields up to lora_name have no default, as in vLLM: omit_defaults
    # then always encodes them, and vLLM's own BlockStored requires them.
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
    # Never set by vLLM: the bridge marks window placeholders it forwards with
    # --keep-placeholders (block_size=0, one hash, no position).
    placeholder: bool = False


class BlockRemoved(_Event):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


E = TypeVar("E")


class EventBatch(msgspec.Struct, Generic[E], array_like=True, omit_defaults=True, gc=False):
    """vLLM's batch, `[ts, events, data_parallel_rank]`, with its events in
    the form `E`: every form the bridge decodes a batch into (the relayed map
    structs here, and in bridge.producer.decode its relay, raw and array
    forms) is this one struct with another `E`."""

    ts: float
    events: list[E]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch[Event]):
    """The batch as the bridge relays it, and as vLLM decodes it."""


def hash_hex(value: BlockHash, width: int = 8) -> str:
    """A short printable form of a block hash, bytes or int, for humans."""
    if isinstance(value, bytes):
        return value.hex()[:width]
    return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"[:width]
