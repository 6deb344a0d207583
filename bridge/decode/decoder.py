"""Turns one vLLM payload into events, skipping only what is broken."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from bridge.contract import Event, KVEventBatch
from bridge.decode.arrays import ArrayEvent, ArrayEventBatch, ArrayRelayEvent, ArrayRelayEventBatch, as_map_events
from bridge.decode.wire import (
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
        self._maps = msgspec.msgpack.Decoder(maps)
        self._arrays = msgspec.msgpack.Decoder(arrays)
        self._arrays_first = False
        self._raw_batch = msgspec.msgpack.Decoder(RawEventBatch)
        self._map_event = msgspec.msgpack.Decoder(RelayEvent if relay else Event)  # type: ignore[arg-type]
        self._lenient_event = msgspec.msgpack.Decoder(LenientRelayEvent if relay else LenientEvent)  # type: ignore[arg-type]
        self._array_event = msgspec.msgpack.Decoder(ArrayRelayEvent if relay else ArrayEvent)  # type: ignore[arg-type]
        self._any = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes) -> DecodedBatch:
        if self._arrays_first:
            batch = self._as_arrays(payload)
            if batch is None:
                batch = self._as_maps(payload)
                if batch is not None:
                    self._arrays_first = False
        else:
            batch = self._as_maps(payload)
            if batch is None:
                batch = self._as_arrays(payload)
                if batch is not None:
                    self._arrays_first = True
        if batch is None:
            return self._decode_slowly(payload)
        if not math.isfinite(batch.ts):
            # JSON has no NaN or infinity: consumers could not read the batch back.
            raise BatchDecodeError("bad_batch", f"non-finite ts {batch.ts!r}")
        if self._relay and not _raw_fields_fit(batch.events):
            return self._decode_slowly(payload)
        return batch

    def _as_maps(self, payload: bytes) -> DecodedBatch | None:
        try:
            batch = self._maps.decode(payload)
        except _DECODE_ERRORS:
            # RecursionError: msgspec's answer to absurd nesting; hostile, not fatal.
            return None
        return DecodedBatch(batch.ts, batch.events, batch.data_parallel_rank, [])  # type: ignore[arg-type]

    def _as_arrays(self, payload: bytes) -> DecodedBatch | None:
        try:
            batch = self._arrays.decode(payload)
        except _DECODE_ERRORS:
            return None
        return DecodedBatch(batch.ts, as_map_events(batch.events), batch.data_parallel_rank, [])

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
        head = memoryview(item)[0] if len(item) else -1
        if head in _ARRAY_HEADS:
            return as_map_events([self._array_event.decode(item)])[0]
        try:
            return self._map_event.decode(item)  # type: ignore[no-any-return]
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
    arrays, optional, nil = _ARRAY_HEADS, _ARRAY_OR_NIL_HEADS, NIL_RAW
    for event in events:
        if type(event) is RelayBlockStored:
            if memoryview(event.token_ids)[0] not in arrays:  # type: ignore[arg-type]
                return False
            extra, lookahead = event.extra_keys, event.lookahead_token_ids
            if extra is not nil and memoryview(extra)[0] not in optional:  # type: ignore[arg-type]
                return False
            if lookahead is not nil and memoryview(lookahead)[0] not in optional:  # type: ignore[arg-type]
                return False
    return True
