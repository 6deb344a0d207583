"""`--prompt-data redact`: what vLLM's stores say of the prompt does not
leave the bridge.

Token ids are the prompt itself, and `extra_keys` carry the request's
`cache_salt` (the tenant's hash secret), LoRA names and multimodal hashes.
Redacted, a store keeps as many token ids as it had, each 0: the residency
rules count them (a store that carries all its blocks' tokens is how vLLM's
re-announcement of a prefix hit is told from a new store), and the count says
nothing of the prompt. Lookahead token ids and `extra_keys` go. Done in place
on the batch's own stores, after normalization, before encoding."""

from __future__ import annotations

from typing import Any

import msgspec

from bridge.contract import BlockRemoved, GroupMessage, WorkerRecord
from bridge.producer.decode.wire import NIL_RAW

_RAW = msgspec.Raw


def _zeros_raw(tokens: msgspec.Raw) -> msgspec.Raw:
    """A msgpack array as long as `tokens`, of zeros (fixint 0 is one byte)."""
    raw = memoryview(tokens)
    if not raw:
        return tokens
    head = raw[0]
    if 0x90 <= head <= 0x9F:
        n, prefix = head & 0x0F, bytes(raw[:1])
    elif head == 0xDC:
        n, prefix = int.from_bytes(raw[1:3], "big"), bytes(raw[:3])
    elif head == 0xDD:
        n, prefix = int.from_bytes(raw[1:5], "big"), bytes(raw[:5])
    else:
        return tokens  # nil or not an array: nothing of the prompt to keep
    return msgspec.Raw(prefix + bytes(n)) if n else tokens


def redact(items: list[GroupMessage | WorkerRecord]) -> int:
    """Redacts every store of `items` in place; returns how many it changed."""
    changed = 0
    removed, raw = BlockRemoved, _RAW
    for item in items:
        if item.__class__ is not GroupMessage:
            continue
        for event in item.events:  # type: ignore[union-attr]
            if event.__class__ is removed:
                continue
            # A BlockStored, or the relay's form of it (RelayBlockStored: Raw fields).
            store: Any = event
            tokens = store.token_ids
            if tokens.__class__ is raw:
                store.token_ids = _zeros_raw(tokens)
                store.extra_keys = NIL_RAW
                store.lookahead_token_ids = NIL_RAW
            else:
                if tokens:
                    store.token_ids = [0] * len(tokens)
                store.extra_keys = None
                store.lookahead_token_ids = None
            changed += 1
    return changed
