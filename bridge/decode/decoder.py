"""Turns one vLLM payload into events, skipping only what is broken."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from bridge.decode.wire import Event, KVEventBatch, RawEventBatch, RelayBlockStored, RelayEvent, RelayEventBatch

# First bytes of a msgpack array: fixarray, array 16, array 32.
_ARRAY_HEADS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))


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
    """Fast path decodes the whole batch in one call; a batch that fails it is
    decoded again event by event so one odd event never costs its neighbours.

    `relay=True` (the msgpack output): stores come out as RelayBlockStored,
    token ids left as the publisher's bytes, checked to be an array. JSON
    output needs them as numbers, decoded and type-checked."""

    def __init__(self, relay: bool = False) -> None:
        self._relay = relay
        batch_type: type[KVEventBatch] | type[RelayEventBatch] = RelayEventBatch if relay else KVEventBatch
        self._batch: msgspec.msgpack.Decoder[KVEventBatch | RelayEventBatch] = msgspec.msgpack.Decoder(batch_type)
        self._raw_batch = msgspec.msgpack.Decoder(RawEventBatch)
        self._event = msgspec.msgpack.Decoder(RelayEvent if relay else Event)  # type: ignore[arg-type]
        self._any = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes) -> DecodedBatch:
        try:
            batch = self._batch.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            # RecursionError: msgspec's answer to absurd nesting; hostile, not fatal.
            return self._decode_slowly(payload)
        if not math.isfinite(batch.ts):
            # JSON has no NaN or infinity: consumers could not read the batch back.
            raise BatchDecodeError("bad_batch", f"non-finite ts {batch.ts!r}")
        events: list[Event] = batch.events  # type: ignore[assignment]
        if self._relay and not _token_arrays(events):
            return self._decode_slowly(payload)
        return DecodedBatch(batch.ts, events, batch.data_parallel_rank, [])

    def _decode_slowly(self, payload: bytes) -> DecodedBatch:
        try:
            raw = self._raw_batch.decode(payload)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise BatchDecodeError("bad_batch", str(exc)[:200]) from None
        if not math.isfinite(raw.ts):
            raise BatchDecodeError("bad_batch", f"non-finite ts {raw.ts!r}")
        events: list[Event] = []
        rejected: list[tuple[str, str]] = []
        for item in raw.events:
            try:
                event = self._event.decode(item)
            except (msgspec.DecodeError, RecursionError) as exc:
                rejected.append(self._classify(item, exc))
                continue
            if self._relay and not _token_arrays([event]):
                rejected.append(("bad_event", "token_ids: expected `array`"))
                continue
            events.append(event)
        return DecodedBatch(raw.ts, events, raw.data_parallel_rank, rejected)

    def _classify(self, item: msgspec.Raw, exc: Exception) -> tuple[str, str]:
        try:
            value: Any = self._any.decode(item)
        except (msgspec.DecodeError, RecursionError):
            return ("bad_event", str(exc)[:200])
        if isinstance(value, dict):
            kind = value.get("type")
            if isinstance(kind, str) and kind not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
                return ("unknown_event_type", kind[:64])
        return ("bad_event", str(exc)[:200])


def _token_arrays(events: list[Event]) -> bool:
    """Whether every relayed store's token ids are a msgpack array (their
    elements are the publisher's word: checking each would cost what relaying
    them undecoded saves)."""
    heads = _ARRAY_HEADS
    for event in events:
        if type(event) is RelayBlockStored and memoryview(event.token_ids)[0] not in heads:  # type: ignore[arg-type]
            return False
    return True
