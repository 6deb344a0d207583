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

from bridge.contract.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event, EventBatch

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


class RelayEventBatch(EventBatch[RelayEvent]):
    """KVEventBatch with stores as RelayBlockStored."""


def empty_tokens(stored: type[BlockStored]) -> list[int] | msgspec.Raw:
    """No token ids, in the form `stored` keeps them."""
    return EMPTY_RAW_ARRAY if stored is RelayBlockStored else []


class RawEventBatch(EventBatch[msgspec.Raw]):
    """The same batch with events left undecoded, for the per-event fallback."""


# -- lenient maps: an event that lacks a field vLLM always sends ---------------


class LenientBlockStored(BlockStored, tag="BlockStored"):
    """A map store missing fields every vLLM release sends (a third-party or
    hand-made publisher): decoded with vLLM's defaults, then made a BlockStored.
    The array forms (bridge.producer.decode.arrays) repeat these defaults
    for the releases that leave trailing fields off."""

    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class LenientRelayBlockStored(LenientBlockStored, tag="BlockStored"):
    token_ids: msgspec.Raw = EMPTY_RAW_ARRAY  # type: ignore[assignment]
    extra_keys: msgspec.Raw = NIL_RAW  # type: ignore[assignment]
    lookahead_token_ids: msgspec.Raw = NIL_RAW  # type: ignore[assignment]


class LenientBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    medium: str | None = None


LenientEvent = Union[LenientBlockStored, LenientBlockRemoved, AllBlocksCleared]
LenientRelayEvent = Union[LenientRelayBlockStored, LenientBlockRemoved, AllBlocksCleared]


# BlockStored's fields that vLLM sends: all but the bridge's own `placeholder`, its last.
VLLM_STORED_FIELDS = BlockStored.__struct_fields__.index("placeholder")

# One instance serves every clear: it has no fields, and nothing changes it.
CLEARED = AllBlocksCleared()


def from_lenient(event: LenientBlockStored | LenientBlockRemoved | AllBlocksCleared, relay: bool) -> Event:
    """A lenient event as the map struct the bridge relays; what it lacked takes vLLM's defaults."""
    if type(event) is LenientBlockRemoved:
        return BlockRemoved(*msgspec.structs.astuple(event))
    if type(event) is not LenientBlockStored and type(event) is not LenientRelayBlockStored:
        return CLEARED
    # The relay's lenient struct holds its undecoded fields as Raw, the other one as lists.
    stored: Any = RelayBlockStored if relay else BlockStored
    return stored(*msgspec.structs.astuple(event)[:VLLM_STORED_FIELDS])
