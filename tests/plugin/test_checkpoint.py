"""Placing a checkpoint in the hash chain, on plain lists."""

from __future__ import annotations

import pytest

from bridge.plugin.checkpoint import Checkpoint, GeometryError, chunk_checkpoint, tail_checkpoint

H = [bytes([i]) * 4 for i in range(12)]  # 12 hashes of 16 tokens each


def test_chunk_parent_is_one_block_back() -> None:
    # 32-token blocks over 16-token hashes: the attention chain is H[1], H[3], H[5], ...
    got = chunk_checkpoint(
        H, chunk_idx=1, tokens_per_block=32, tokens_per_chunk=64, hashes_per_chunk=4
    )
    assert got == Checkpoint(H[7], H[5], 32)


def test_single_block_chunk_parent_is_previous_chunk() -> None:
    kw = dict(tokens_per_block=64, tokens_per_chunk=64, hashes_per_chunk=4)
    assert chunk_checkpoint(H, chunk_idx=0, **kw) == Checkpoint(H[3], None, 64)
    assert chunk_checkpoint(H, chunk_idx=2, **kw) == Checkpoint(H[11], H[7], 64)


def test_hash_granular_chunk() -> None:
    got = chunk_checkpoint(
        H, chunk_idx=0, tokens_per_block=16, tokens_per_chunk=32, hashes_per_chunk=2
    )
    assert got == Checkpoint(H[1], H[0], 16)


def test_tail_is_hash_granular() -> None:
    kw = dict(tokens_per_chunk=64, hashes_per_chunk=4)
    assert tail_checkpoint(H, boundary_tokens=96, **kw) == Checkpoint(H[5], H[4], 16)
    assert tail_checkpoint(H, boundary_tokens=16, **kw) == Checkpoint(H[0], None, 16)


@pytest.mark.parametrize(
    "kw",
    [
        dict(chunk_idx=3, tokens_per_block=32, tokens_per_chunk=64, hashes_per_chunk=4),
        dict(chunk_idx=-1, tokens_per_block=32, tokens_per_chunk=64, hashes_per_chunk=4),
        dict(chunk_idx=0, tokens_per_block=24, tokens_per_chunk=64, hashes_per_chunk=4),
        dict(chunk_idx=0, tokens_per_block=32, tokens_per_chunk=64, hashes_per_chunk=0),
        dict(chunk_idx=0, tokens_per_block=32, tokens_per_chunk=64, hashes_per_chunk=3),
    ],
    ids=["past-the-end", "negative", "block-not-hash-multiple", "no-hashes", "uneven-hashes"],
)
def test_chunk_geometry_errors(kw: dict[str, int]) -> None:
    with pytest.raises(GeometryError):
        chunk_checkpoint(H, **kw)


@pytest.mark.parametrize("boundary", [0, 40, 13 * 16])
def test_tail_geometry_errors(boundary: int) -> None:
    with pytest.raises(GeometryError):
        tail_checkpoint(H, boundary_tokens=boundary, tokens_per_chunk=64, hashes_per_chunk=4)


def test_uncomputed_hash_is_refused() -> None:
    hashes: list[bytes | None] = [H[0], None, H[2], H[3]]
    with pytest.raises(GeometryError):
        chunk_checkpoint(
            hashes, chunk_idx=0, tokens_per_block=32, tokens_per_chunk=64, hashes_per_chunk=4
        )
