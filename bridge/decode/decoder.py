"""Turns one vLLM payload into events, skipping only what is broken."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from bridge.decode.wire import Event, KVEventBatch, RawEventBatch


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
    decoded again event by event so one odd event never costs its neighbours."""

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(KVEventBatch)
        self._raw_batch = msgspec.msgpack.Decoder(RawEventBatch)
        self._event = msgspec.msgpack.Decoder(Event)
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
        return DecodedBatch(batch.ts, batch.events, batch.data_parallel_rank, [])

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
                events.append(self._event.decode(item))
            except (msgspec.DecodeError, RecursionError) as exc:
                rejected.append(self._classify(item, exc))
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
