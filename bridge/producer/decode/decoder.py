"""Turns one vLLM payload into events, skipping only what is broken."""

from __future__ import annotations

import math
import struct
from typing import Any

import msgspec

from bridge.contract import Event, KVEventBatch
from bridge.producer.decode.arrays import ArrayEvent, ArrayEventBatch, ArrayRelayEvent, ArrayRelayEventBatch, as_map_events
from bridge.producer.decode.wire import (
    NIL_RAW,
    LenientEvent,
    LenientRelayEvent,
    RawEventBatch,
    RelayBlockStored,
    RelayEvent,
    RelayEventBatch,
    from_lenient,
)

# First bytes of a msgpack array: fixarray, array 16, array 32.
_ARRAY_HEADS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))
_ARRAY_OR_NIL_HEADS = _ARRAY_HEADS | {0xC0}
# First bytes of a msgpack map: fixmap, map 16, map 32.
_MAP_HEADS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))
_EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_DECODE_ERRORS = (msgspec.DecodeError, RecursionError)
# The first byte of a buffer, as a 1-tuple: half what a memoryview costs, and
# the relay looks at one per store. A decoded Raw is never empty.
_HEAD = struct.Struct("B").unpack_from


class DecodedBatch(msgspec.Struct, gc=False):
    ts: float
    events: list[Event]
    dp_rank: int | None
    # (reason, detail) for every event that could not be decoded; the rest of
    # the batch is still good and goes on.
    rejected: list[tuple[str, str]]


class BatchDecodeError(Exception):
    """The payload is not a KVEventBatch at all."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class BatchDecoder:
    """Fast path decodes the whole batch in one call, as maps (vLLM 0.24.0 and
    later) or as arrays (0.9.0 through 0.23.0); it tries first the form this
    publisher sent last, since a process never changes it. A batch that fails
    both is decoded again event by event so one odd event never costs its
    neighbours. One decoder serves one publisher.

    `relay=True` (the msgpack output): stores come out as RelayBlockStored,
    token ids left as the publisher's bytes, checked to be an array. JSON
    output needs them as numbers, decoded and type-checked."""

    def __init__(self, relay: bool = False) -> None:
        self._relay = relay
        maps: type[KVEventBatch] | type[RelayEventBatch] = RelayEventBatch if relay else KVEventBatch
        arrays: type[ArrayEventBatch] | type[ArrayRelayEventBatch] = ArrayRelayEventBatch if relay else ArrayEventBatch
        # The form this publisher sent last is tried first: a process never changes it.
        self._first: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(maps)
        self._second: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(arrays)
        self._arrays_first = False
        self._raw_batch = msgspec.msgpack.Decoder(RawEventBatch)
        self._map_event = msgspec.msgpack.Decoder(RelayEvent if relay else Event)
        self._lenient_event = msgspec.msgpack.Decoder(LenientRelayEvent if relay else LenientEvent)
        self._array_event = msgspec.msgpack.Decoder(ArrayRelayEvent if relay else ArrayEvent)
        self._any = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes) -> DecodedBatch:
        try:
            batch = self._first.decode(payload)
        except _DECODE_ERRORS:
            # RecursionError: msgspec's answer to absurd nesting; hostile, not fatal.
            try:
                batch = self._second.decode(payload)
            except _DECODE_ERRORS:
                return self._decode_slowly(payload)
            self._first, self._second = self._second, self._first
            self._arrays_first = not self._arrays_first
        events = as_map_events(batch.events) if self._arrays_first else batch.events
        if not math.isfinite(batch.ts):
            # JSON has no NaN or infinity: consumers could not read the batch back.
            raise BatchDecodeError("bad_batch", f"non-finite ts {batch.ts!r}")
        if self._relay and not _raw_fields_fit(events):
            return self._decode_slowly(payload)
        return DecodedBatch(batch.ts, events, batch.data_parallel_rank, [])

    def _decode_slowly(self, payload: bytes) -> DecodedBatch:
        try:
            raw = self._raw_batch.decode(payload)
        except _DECODE_ERRORS as exc:
            raise BatchDecodeError("bad_batch", str(exc)[:200]) from None
        if not math.isfinite(raw.ts):
            raise BatchDecodeError("bad_batch", f"non-finite ts {raw.ts!r}")
        events: list[Event] = []
        rejected: list[tuple[str, str]] = []
        for item in raw.events:
            try:
                event = self._decode_event(item)
            except _DECODE_ERRORS as exc:
                rejected.append(self._classify(item, exc))
                continue
            if self._relay and not _raw_fields_fit([event]):
                rejected.append(("bad_event", "token_ids, extra_keys or lookahead_token_ids: expected `array`"))
                continue
            events.append(event)
        return DecodedBatch(raw.ts, events, raw.data_parallel_rank, rejected)

    def _decode_event(self, item: msgspec.Raw) -> Event:
        """One event in whichever form it came; raises what msgspec raises."""
        head = _HEAD(item)[0] if len(item) else -1
        if head in _ARRAY_HEADS:
            return as_map_events([self._array_event.decode(item)])[0]
        try:
            return self._map_event.decode(item)
        except _DECODE_ERRORS:
            if head not in _MAP_HEADS:
                raise
        return from_lenient(self._lenient_event.decode(item), self._relay)

    def _classify(self, item: msgspec.Raw, exc: Exception) -> tuple[str, str]:
        try:
            value: Any = self._any.decode(item)
        except _DECODE_ERRORS:
            return ("bad_event", str(exc)[:200])
        kind = None
        if isinstance(value, dict):
            kind = value.get("type")
        elif isinstance(value, list) and value:
            kind = value[0]
        if isinstance(kind, str) and kind not in _EVENT_TYPES:
            return ("unknown_event_type", kind[:64])
        return ("bad_event", str(exc)[:200])


def _raw_fields_fit(events: list[Event]) -> bool:
    """Whether every relayed store's token ids are a msgpack array, and its
    extra keys and lookahead token ids an array or nil (their elements are the
    publisher's word: checking each would cost what relaying them undecoded
    saves). The two optional fields are mostly left out: then they are the
    default object itself, and no buffer is looked at."""
    arrays, optional, nil, relay, head = _ARRAY_HEADS, _ARRAY_OR_NIL_HEADS, NIL_RAW, RelayBlockStored, _HEAD
    for event in events:
        if event.__class__ is relay:
            if head(event.token_ids)[0] not in arrays:
                return False
            extra = event.extra_keys
            if extra is not nil and head(extra)[0] not in optional:
                return False
            lookahead = event.lookahead_token_ids
            if lookahead is not nil and head(lookahead)[0] not in optional:
                return False
    return True
