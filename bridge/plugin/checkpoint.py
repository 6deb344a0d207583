"""Where a recurrent-state checkpoint sits in a request's block-hash chain.

A Mamba group's offloaded chunk holds the recurrent state after the chunk's
last token, so it is reusable only at that one position: the chunk's last
block hash, the same hash the full-attention event for that chunk ends with.

Parent choice: the parent is the hash that precedes the checkpoint in the
chain an attention group of the same geometry announces. For a complete chunk
that chain is block-granular (`tokens_per_block`), so the parent is the hash
one block earlier: the attention event's second-to-last hash, or its
`parent_block_hash` when the chunk is a single block (the previous chunk's
last hash; none for the first chunk). For a partial tail the attention event
is hash-granular (`tokens_per_hash`), so the parent is the hash one
`tokens_per_hash` earlier, again the attention event's second-to-last hash or
its parent. Either way a consumer finds the parent in the attention events it
already holds and can link the checkpoint into that chain.

Pure functions on plain sequences, so they can be checked without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Checkpoint(NamedTuple):
    """The one hash a recurrent checkpoint is announced at, and its neighbours."""

    block_hash: bytes
    parent_block_hash: bytes | None
    # What an attention group with the same geometry reports as block_size.
    block_size: int


class GeometryError(ValueError):
    """The chunk geometry or the hash list cannot place the checkpoint."""


def _tokens_per_hash(tokens_per_chunk: int, hashes_per_chunk: int) -> int:
    if hashes_per_chunk <= 0 or tokens_per_chunk <= 0:
        raise GeometryError(
            f"tokens_per_chunk={tokens_per_chunk}, hashes_per_chunk={hashes_per_chunk}"
        )
    if tokens_per_chunk % hashes_per_chunk:
        raise GeometryError(
            f"tokens_per_chunk={tokens_per_chunk} is not a multiple of "
            f"hashes_per_chunk={hashes_per_chunk}"
        )
    return tokens_per_chunk // hashes_per_chunk


def _hash_at(block_hashes: Sequence[bytes | None], idx: int) -> bytes:
    if not 0 <= idx < len(block_hashes):
        raise GeometryError(f"hash index {idx} outside 0..{len(block_hashes) - 1}")
    block_hash = block_hashes[idx]
    if block_hash is None:
        raise GeometryError(f"hash {idx} is not computed yet")
    return block_hash


def chunk_checkpoint(
    block_hashes: Sequence[bytes | None],
    *,
    chunk_idx: int,
    tokens_per_block: int,
    tokens_per_chunk: int,
    hashes_per_chunk: int,
) -> Checkpoint:
    """The checkpoint of complete chunk `chunk_idx` (0-based) of a request."""
    tokens_per_hash = _tokens_per_hash(tokens_per_chunk, hashes_per_chunk)
    if chunk_idx < 0:
        raise GeometryError(f"chunk_idx={chunk_idx}")
    if tokens_per_block <= 0 or tokens_per_block % tokens_per_hash:
        raise GeometryError(
            f"tokens_per_block={tokens_per_block} is not a multiple of "
            f"tokens_per_hash={tokens_per_hash}"
        )
    hashes_per_block = tokens_per_block // tokens_per_hash
    last_idx = (chunk_idx + 1) * hashes_per_chunk - 1
    parent_idx = last_idx - hashes_per_block
    return Checkpoint(
        block_hash=_hash_at(block_hashes, last_idx),
        parent_block_hash=_hash_at(block_hashes, parent_idx) if parent_idx >= 0 else None,
        block_size=tokens_per_block,
    )


def tail_checkpoint(
    block_hashes: Sequence[bytes | None],
    *,
    boundary_tokens: int,
    tokens_per_chunk: int,
    hashes_per_chunk: int,
) -> Checkpoint:
    """The checkpoint of a partial tail whose valid tokens end at `boundary_tokens`."""
    tokens_per_hash = _tokens_per_hash(tokens_per_chunk, hashes_per_chunk)
    if boundary_tokens <= 0 or boundary_tokens % tokens_per_hash:
        raise GeometryError(
            f"boundary_tokens={boundary_tokens} is not a positive multiple of "
            f"tokens_per_hash={tokens_per_hash}"
        )
    last_idx = boundary_tokens // tokens_per_hash - 1
    return Checkpoint(
        block_hash=_hash_at(block_hashes, last_idx),
        parent_block_hash=_hash_at(block_hashes, last_idx - 1) if last_idx >= 1 else None,
        block_size=tokens_per_hash,
    )
