"""The payload formats (`--format`, the `Kvb-Format` header) and the msgspec
codec for each, so bridge and consumers read and write them alike."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

import msgspec

FORMATS: Final = ("msgpack", "json")
# What a message without a `Kvb-Format` header is taken to be.
DEFAULT_FORMAT: Final = "msgpack"

# A msgpack array's header, read in place with struct: a memoryview and a
# slice of it took about twice as long, and the keeper reads one per store.
_HEAD = struct.Struct(">B").unpack_from
_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from


def encoder_for(fmt: str) -> Callable[[Any], bytes]:
    """The encode function of `fmt`; raises ValueError for an unknown format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    return msgspec.msgpack.Encoder().encode if fmt == "msgpack" else msgspec.json.Encoder().encode


def decoder_for(fmt: str, type_: type) -> msgspec.msgpack.Decoder | msgspec.json.Decoder:
    """A decoder of `type_` for `fmt` (anything but msgpack reads as JSON)."""
    return msgspec.msgpack.Decoder(type_) if fmt == "msgpack" else msgspec.json.Decoder(type_)


def array_header(raw: Any) -> tuple[int, int]:
    """(items, header bytes) of the msgpack array the buffer `raw` holds
    (an undecoded field, `msgspec.Raw`); (0, 0) when it holds no array:
    empty, nil, any other type, or a header cut short."""
    size = len(raw)
    if not size:
        return 0, 0
    head: int = _HEAD(raw)[0]
    if 0x90 <= head <= 0x9F:  # fixarray
        return head & 0x0F, 1
    if head == 0xDC and size >= 3:  # array 16
        return _U16(raw, 1)[0], 3
    if head == 0xDD and size >= 5:  # array 32
        return _U32(raw, 1)[0], 5
    return 0, 0
