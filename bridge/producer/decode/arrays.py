"""Array-form events (vLLM 0.9.0 through 0.23.0) and their turn into map structs.

Those releases encode each event as `[tag, field, ...]`, fields only ever
appended, so one positional order covers them all:
BlockStored `[tag, block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium (0.10.2), lora_name (0.14.0), extra_keys (0.17.0), group_idx
(0.20.0), kv_cache_spec_kind, kv_cache_spec_sliding_window (0.22.0)]`,
BlockRemoved `[tag, block_hashes, medium (0.10.2), group_idx (0.20.0)]`,
AllBlocksCleared `[tag]`; trailing defaults left off.

Each array struct here is a subclass of the map struct the bridge relays, with
the same fields: decoded as an array, it becomes the map struct by taking that
class (`__class__` assignment, which CPython allows between classes of one
layout). That costs a tenth of building a new struct per event. Positions past
the last field any array release sent are decoded as anything and blanked, so
an extra element is ignored, never taken for a field of the map form.
`RETYPE` says whether this Python and msgspec allow the assignment; where they
do not, each event is built anew (`retype=False`), with the same result.
"""

from __future__ import annotations

from typing import Any, Final, Union

import msgspec

from bridge.contract import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event
from bridge.contract.events import EventBatch
from bridge.producer.decode.wire import CLEARED, EMPTY_RAW_ARRAY, NIL_RAW, RelayBlockStored


# The array structs subclass the relayed map structs directly, not the lenient
# ones that hold the same defaults: the class swap walks both classes' bases,
# and one more level costs 1 % of the array decode (callgrind).
class ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # Never sent in array form: whatever stands there is dropped.
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    lookahead_token_ids: Any = None
    placeholder: Any = False


class ArrayRelayBlockStored(RelayBlockStored, array_like=True, tag="BlockStored"):
    parent_block_hash: BlockHash | None = None
    token_ids: msgspec.Raw = EMPTY_RAW_ARRAY
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    # RelayBlockStored's default: left alone when the array stops short of it
    lookahead_token_ids: Any = NIL_RAW
    placeholder: Any = False


class ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    medium: str | None = None
    locality: Any = None
    ownership: Any = None


class ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


ArrayEvent = Union[ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared]
ArrayRelayEvent = Union[ArrayRelayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared]


class ArrayEventBatch(EventBatch[ArrayEvent]):
    pass


class ArrayRelayEventBatch(EventBatch[ArrayRelayEvent]):
    pass


# The fields some array release sent: those before `locality` (0.26.0, when
# events were already maps).
_ARRAY_STORED_FIELDS: Final = BlockStored.__struct_fields__.index("locality")
_ARRAY_REMOVED_FIELDS: Final = BlockRemoved.__struct_fields__.index("locality")
_STORES: Final = (ArrayBlockStored, ArrayRelayBlockStored)


def _rebuilt(event: Any) -> Event:
    cls = type(event)
    if cls is ArrayBlockRemoved:
        return BlockRemoved(*msgspec.structs.astuple(event)[:_ARRAY_REMOVED_FIELDS])
    if cls in _STORES:
        stored = RelayBlockStored if cls is ArrayRelayBlockStored else BlockStored
        return stored(*msgspec.structs.astuple(event)[:_ARRAY_STORED_FIELDS])
    return CLEARED


def as_map_events(events: list[Any], retype: bool | None = None) -> list[Event]:
    """`events` (decoded as arrays) as the map structs the bridge relays, in
    place; by the class swap where `RETYPE` (the default) says it works."""
    if not (RETYPE if retype is None else retype):
        return [_rebuilt(event) for event in events]
    stored, relay_stored, removed, nil = ArrayBlockStored, ArrayRelayBlockStored, ArrayBlockRemoved, NIL_RAW
    for event in events:
        cls = event.__class__
        if cls is relay_stored:
            # Setting a field costs six times looking at it: only what an
            # over-long array filled is blanked.
            if (event.locality is not None or event.ownership is not None or event.session_id is not None
                    or event.lookahead_token_ids is not nil or event.placeholder is not False):
                _blank_store(event, nil)
            if event.extra_keys == nil:
                # nil that stood only to reach a later position: relayed as left out
                event.extra_keys = nil
            event.__class__ = RelayBlockStored
        elif cls is stored:
            if (event.locality is not None or event.ownership is not None or event.session_id is not None
                    or event.lookahead_token_ids is not None or event.placeholder is not False):
                _blank_store(event, None)
            event.__class__ = BlockStored
        elif cls is removed:
            if event.locality is not None or event.ownership is not None:
                event.locality = event.ownership = None
            event.__class__ = BlockRemoved
        else:
            event.__class__ = AllBlocksCleared
    return events


def _blank_store(event: Any, lookahead: Any) -> None:
    """The fields no array release sent, as the map struct's defaults."""
    event.locality = event.ownership = event.session_id = None
    event.lookahead_token_ids = lookahead
    event.placeholder = False


def _retype_works() -> bool:
    """Whether the class swap works here and relays what building anew does."""
    def probe() -> Any:
        return ArrayRelayBlockStored([1], None, EMPTY_RAW_ARRAY, 16, None, "GPU", None, NIL_RAW, 2, "mamba")

    want = msgspec.msgpack.encode(_rebuilt(probe()))
    try:
        swapped = as_map_events([probe()], retype=True)[0]
    except TypeError:
        return False
    return type(swapped) is RelayBlockStored and msgspec.msgpack.encode(swapped) == want


RETYPE: Final = _retype_works()
