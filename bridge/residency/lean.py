"""Group messages as residency reads them: only the fields its rules use.

A consumer that keeps residency and nothing else (the bridge's own keeper, an
index behind a router) need not build every token id of every store: decoding
`token_ids` as a list of ints is most of what a full `GroupMessage` decode
costs. `ResidencyMessage` takes the same msgpack payload, leaves token ids as
the encoded array (`msgspec.Raw`) and drops the fields residency never reads
(unknown map keys are skipped). `ResidencyIndex.apply_group` takes either
form, and gives the same view for both.
"""

from __future__ import annotations

from typing import Union

import msgspec

from bridge.contract.codec import array_header
from bridge.contract.events import BlockHash, BlockRemoved, BlockStored
from bridge.contract.messages import GroupHead

_EMPTY = msgspec.Raw()


class LeanStored(msgspec.Struct, tag="BlockStored", gc=False):
    """A `BlockStored` with its token ids left encoded."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: msgspec.Raw = _EMPTY
    block_size: int = 0
    medium: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    placeholder: bool = False


class ResidencyMessage(GroupHead):
    """A `GroupMessage` with the fields residency reads; its events are the
    contract's group events (`GroupEvent`): a clear splits a batch, it is
    never an event of a group message, and a payload with one is refused."""

    events: list[Union[LeanStored, BlockRemoved]]
    topic: str = ""
    part: int = 0
    chunk: int = 0


def residency_decoder() -> msgspec.msgpack.Decoder[ResidencyMessage]:
    """Reads a msgpack group payload (the JSON format decodes in full)."""
    return msgspec.msgpack.Decoder(ResidencyMessage)


def token_count(event: BlockStored | LeanStored) -> int:
    """How many token ids a store carries, in either form."""
    tokens = event.token_ids
    if type(tokens) is list:
        return len(tokens)
    return array_header(tokens)[0]
