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
from bridge.contract.codec import array_header
from bridge.producer.decode.wire import NIL_RAW

_RAW = msgspec.Raw
# Distinct token counts whose zero arrays are kept: a store's count is at most
# its blocks' tokens, so a real engine repeats a few hundred counts at most;
# past the bound (hostile frames) arrays are made afresh, never kept.
MAX_CACHED_COUNTS = 4096


class PromptRedactor:
    """Redacts stores in place. The zero array of each token count is made
    once and kept: making a `msgspec.Raw` per store cost the relay more than
    reading the count does (docs/security.md, "What a reader sees")."""

    def __init__(self) -> None:
        self._zeros: dict[int, msgspec.Raw] = {}

    @property
    def cached_counts(self) -> int:
        return len(self._zeros)

    def zeros(self, tokens: msgspec.Raw) -> msgspec.Raw:
        """A msgpack array as long as `tokens`, of zeros (fixint 0 is one byte)."""
        n, header = array_header(tokens)
        if not n:
            return tokens  # empty, nil or not an array: nothing of the prompt to keep
        zeros = self._zeros.get(n)
        if zeros is None:
            zeros = msgspec.Raw(bytes(memoryview(tokens)[:header]) + bytes(n))
            if len(self._zeros) < MAX_CACHED_COUNTS:
                self._zeros[n] = zeros
        return zeros

    def redact(self, items: list[GroupMessage | WorkerRecord]) -> int:
        """Redacts every store of `items` in place; returns how many it changed."""
        changed = 0
        removed, raw, zeros = BlockRemoved, _RAW, self.zeros
        for item in items:
            if item.__class__ is not GroupMessage:
                continue
            for event in item.events:
                if event.__class__ is removed:
                    continue
                # A BlockStored, or the relay's form of it (RelayBlockStored: Raw fields).
                store: Any = event
                tokens = store.token_ids
                if tokens.__class__ is raw:
                    store.token_ids = zeros(tokens)
                    store.extra_keys = NIL_RAW
                    store.lookahead_token_ids = NIL_RAW
                else:
                    if tokens:
                        store.token_ids = [0] * len(tokens)
                    store.extra_keys = None
                    store.lookahead_token_ids = None
                changed += 1
        return changed
