"""The forms the bridge decodes vLLM's events into on their way to the contract's
map structs (bridge.contract.events), for every release that publishes them.

Two encodings reach the bridge: tagged maps (vLLM 0.24.0 and later), and msgpack
arrays `[tag, field, ...]` (0.9.0 through 0.23.0, bridge.producer.decode.arrays). Both
end as the contract's map structs, which are what the bridge relays. Here: the
relay's store that keeps fields it never reads as msgpack bytes, the batch with
events left undecoded for the per-event fallback, and lenient maps for a
publisher that leaves out fields vLLM always sends.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from bridge.contract.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event


class _LenientEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


EMPTY_RAW_ARRAY = msgspec.Raw(b"\x90")
# The relayed form of a field vLLM left out: the default, so omit_defaults leaves it out too.
NIL_RAW = msgspec.Raw(b"\xc0")


class RelayBlockStored(BlockStored, tag="BlockStored"):
    """BlockStored as the bridge relays it in msgpack: token ids, extra keys
    and lookahead token ids kept as the publisher's msgpack bytes. The bridge
    never reads them; decoding then re-encoding every token as a Python int was
    a third of its work per event, and a frame of tiny elements would decode
    into one Python object per byte. The decoder checks that each is an array
    (or, for the optional two, nil); consumers decode BlockStored."""

    token_ids: msgspec.Raw  # type: ignore[assignment]
    extra_keys: msgspec.Raw = NIL_RAW  # type: ignore[assignment]
    lookahead_token_ids: msgspec.Raw = NIL_RAW  # type: ignore[assignment]


RelayEvent = Union[RelayBlockStored, BlockRemoved, AllBlocksCleared]


class RelayEventBatch(msgspec.Struct, array_like=True, gc=False):
    """KVEventBatch with stores as RelayBlockStored."""

    ts: float
    events: list[RelayEvent]
    data_parallel_rank: int | None = None


def empty_tokens(stored: type[BlockStored]) -> list[int] | msgspec.Raw:
    """No token ids, in the form `stored` keeps them."""
    return EMPTY_RAW_ARRAY if stored is RelayBlockStored else []


class RawEventBatch(msgspec.Struct, array_like=True, gc=False):
    """The same batch with events left undecoded, for the per-event fallback."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


# -- lenient maps: an event that lacks a field vLLM always sends ---------------


class LenientBlockStored(_LenientEvent, tag="BlockStored"):
    """A map store missing fields every vLLM release sends (a third-party or
    hand-made publisher): decoded with vLLM's defaults, then made a BlockStored."""

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


class LenientRelayBlockStored(LenientBlockStored, tag="BlockStored"):
    token_ids: msgspec.Raw = EMPTY_RAW_ARRAY  # type: ignore[assignment]
    extra_keys: msgspec.Raw = NIL_RAW  # type: ignore[assignment]
    lookahead_token_ids: msgspec.Raw = NIL_RAW  # type: ignore[assignment]


class LenientBlockRemoved(_LenientEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


LenientEvent = Union[LenientBlockStored, LenientBlockRemoved, AllBlocksCleared]
LenientRelayEvent = Union[LenientRelayBlockStored, LenientBlockRemoved, AllBlocksCleared]


# One instance serves every clear: it has no fields, and nothing changes it.
CLEARED = AllBlocksCleared()


def from_lenient(event: LenientBlockStored | LenientBlockRemoved | AllBlocksCleared, relay: bool) -> Event:
    """A lenient event as the map struct the bridge relays; what it lacked takes vLLM's defaults."""
    if type(event) is LenientBlockRemoved:
        return BlockRemoved(event.block_hashes, event.medium, event.group_idx, event.locality, event.ownership)
    if type(event) is not LenientBlockStored and type(event) is not LenientRelayBlockStored:
        return CLEARED
    # The relay's lenient struct holds its undecoded fields as Raw, the other one as lists.
    stored: Any = RelayBlockStored if relay else BlockStored
    return stored(  # type: ignore[no-any-return]
        event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, event.lora_id,
        event.medium, event.lora_name, event.extra_keys, event.group_idx, event.kv_cache_spec_kind,
        event.kv_cache_spec_sliding_window, event.locality, event.ownership, event.session_id,
        event.lookahead_token_ids,
    )
