"""Where the contract lives on NATS: `<prefix>.<worker>.<group>` and
`<prefix>.<worker>.worker` subjects, and the JetStream stream that keeps them.

Worker ids come from pod names, host names or operators, so they may hold
anything. Each id is escaped into exactly one subject token, injectively:
ASCII letters, digits, `_` and `-` stay; every other UTF-8 byte (`~` itself
included) becomes `~XX` (upper-case hex). A data-parallel rank r > 0 appends
`-dp<r>`; an id whose escaped form already ends in `-dp<digits>` has that hyphen
escaped (`~2D`) so no (id, rank) pair can collide with another.
"""

from __future__ import annotations

import re
from typing import Final

# The last token of a worker's record subject; a group subject ends in a number.
WORKER_TOKEN: Final = "worker"
# The JetStream stream the bridge creates (`--stream-name`) and consumers replay.
DEFAULT_STREAM: Final = "KV_EVENTS"
MAX_WORKER_ID_BYTES: Final = 200

_PLAIN: Final = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_DP_SUFFIX: Final = re.compile(r"-dp[0-9]+$")
_PREFIX_TOKEN: Final = re.compile(r"[A-Za-z0-9_-]+")


def escape_token(text: str) -> str:
    out: list[str] = []
    for byte in text.encode("utf-8"):
        out.append(chr(byte) if byte in _PLAIN else f"~{byte:02X}")
    return "".join(out)


def unescape_token(token: str) -> str:
    raw = bytearray()
    i = 0
    while i < len(token):
        ch = token[i]
        if ch == "~":
            raw.append(int(token[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(ch))
            i += 1
    return raw.decode("utf-8")


def worker_token(worker_id: str, dp_rank: int) -> str:
    token = escape_token(worker_id)
    match = _DP_SUFFIX.search(token)
    if match:
        start = match.start()
        token = f"{token[:start]}~2D{token[start + 1:]}"
    return f"{token}-dp{dp_rank}" if dp_rank > 0 else token


def parse_worker_token(token: str) -> tuple[str, int]:
    """The inverse of `worker_token`."""
    match = _DP_SUFFIX.search(token)
    if match:
        return unescape_token(token[: match.start()]), int(match.group()[3:])
    return unescape_token(token), 0


def validate_worker_id(worker_id: str) -> str:
    if not worker_id:
        raise ValueError("worker id must not be empty")
    if len(worker_id.encode("utf-8")) > MAX_WORKER_ID_BYTES:
        raise ValueError(f"worker id longer than {MAX_WORKER_ID_BYTES} bytes")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in worker_id):
        raise ValueError("worker id holds control characters")
    return worker_id


def validate_prefix(prefix: str) -> str:
    """The prefix is operator-chosen and may span tokens (`kv.prod`); each token
    must be plain so the prefix cannot hold wildcards."""
    tokens = prefix.split(".")
    if not all(_PREFIX_TOKEN.fullmatch(t) for t in tokens):
        raise ValueError(f"subject prefix {prefix!r}: tokens of [A-Za-z0-9_-] joined by '.'")
    return prefix
