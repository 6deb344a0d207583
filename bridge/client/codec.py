"""Bus payloads → contract structs, whichever format the bridge was told to use.

The `Kvb-Format` header names the encoding. Messages without it (a foreign or
older publisher) are sniffed: a contract struct is a map, so msgpack starts
with a map marker and JSON with `{`, a byte msgpack never uses for a map.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from bridge.contract import FORMATS, HDR_FORMAT, HDR_RECORD, WORKER_TOKEN, GroupMessage, WorkerRecord, decoder_for

Body = GroupMessage | WorkerRecord

_JSON_START: Final = 0x7B  # "{"


class BusDecodeError(ValueError):
    """A message on the contract's subjects that is not a contract struct."""


class BusCodec:
    """Decoders made once; one instance serves any number of messages."""

    def __init__(self) -> None:
        self._group: dict[str, Any] = {fmt: decoder_for(fmt, GroupMessage) for fmt in FORMATS}
        self._record: dict[str, Any] = {fmt: decoder_for(fmt, WorkerRecord) for fmt in FORMATS}

    @staticmethod
    def is_record(subject: str, headers: dict[str, str] | None) -> bool:
        if headers and HDR_RECORD in headers:
            return True
        return subject.rpartition(".")[2] == WORKER_TOKEN

    @staticmethod
    def format_of(data: bytes, headers: dict[str, str] | None) -> str:
        fmt = headers.get(HDR_FORMAT) if headers else None
        if fmt in FORMATS:
            return fmt
        return "json" if data[:1] == bytes([_JSON_START]) else "msgpack"

    def decode(self, subject: str, headers: dict[str, str] | None, data: bytes) -> Body:
        if not data:
            raise BusDecodeError(f"{subject}: empty payload")
        fmt = self.format_of(data, headers)
        table = self._record if self.is_record(subject, headers) else self._group
        try:
            body: Body = table[fmt].decode(data)
            return body
        except msgspec.DecodeError as exc:
            raise BusDecodeError(f"{subject}: {fmt} payload is not a contract struct: {exc}") from None
