"""The payload formats (`--format`, the `Kvb-Format` header) and the msgspec
codec for each, so bridge and consumers read and write them alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgspec

FORMATS: Final = ("msgpack", "json")
# What a message without a `Kvb-Format` header is taken to be.
DEFAULT_FORMAT: Final = "msgpack"


def encoder_for(fmt: str) -> Callable[[Any], bytes]:
    """The encode function of `fmt`; raises ValueError for an unknown format."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}")
    return msgspec.msgpack.Encoder().encode if fmt == "msgpack" else msgspec.json.Encoder().encode


def decoder_for(fmt: str, type_: type) -> msgspec.msgpack.Decoder | msgspec.json.Decoder:
    """A decoder of `type_` for `fmt` (anything but msgpack reads as JSON)."""
    return msgspec.msgpack.Decoder(type_) if fmt == "msgpack" else msgspec.json.Decoder(type_)
