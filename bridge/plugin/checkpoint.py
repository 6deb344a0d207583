"""Where a recurrent-state checkpoint sits in the hash chain vLLM announces.

A Mamba group's offloaded chunk holds the recurrent state after the chunk's
last token, so it is reusable only at that one position: the chunk's last
hash, the same hash the full-attention event for that chunk ends with.

The plugin lets vLLM build the payload it would announce for an attention
group of the same geometry, then cuts it down to that one position:

- the hash is the payload's last hash;
- the parent is the hash before it in that same payload, or the payload's
  own parent when the payload holds a single hash (a one-block chunk: the
  previous chunk's last hash, none for the first chunk).

So the parent is always a hash the consumer has already seen in the
attention events of that vLLM release, whatever granularity that release
announces (one hash per block, or one per hash block), and `block_size`
stays what the attention event reports. This is the rule vLLM 0.34 applies
natively.

Pure functions on plain sequences, so they can be checked without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, NamedTuple, TypeVar

H = TypeVar("H")


class Checkpoint(NamedTuple, Generic[H]):
    """The one hash a recurrent checkpoint is announced at, and its parent."""

    block_hash: H
    parent_block_hash: H | None


class GeometryError(ValueError):
    """The payload cannot place a checkpoint."""


def checkpoint_of(block_hashes: Sequence[H], parent_block_hash: H | None) -> Checkpoint[H]:
    """The checkpoint of an attention-shaped payload: its last hash, chained to the one before."""
    if not block_hashes:
        raise GeometryError("the payload has no hashes")
    if len(block_hashes) == 1:
        return Checkpoint(block_hashes[0], parent_block_hash)
    return Checkpoint(block_hashes[-1], block_hashes[-2])
