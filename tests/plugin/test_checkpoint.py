"""Cutting an attention-shaped payload down to its checkpoint, on plain lists."""

from __future__ import annotations

import pytest

from bridge.plugin.checkpoint import Checkpoint, GeometryError, checkpoint_of

H = [bytes([i]) * 4 for i in range(12)]


def test_block_granular_chunk_parent_is_one_block_back() -> None:
    # 32-token blocks over 16-token hashes: chunk 1's attention payload is [H[5], H[7]].
    assert checkpoint_of([H[5], H[7]], H[3]) == Checkpoint(H[7], H[5])


def test_hash_granular_chunk_parent_is_one_hash_back() -> None:
    # A release that announces every hash: chunk 1 is [H[4]..H[7]].
    assert checkpoint_of(H[4:8], H[3]) == Checkpoint(H[7], H[6])


def test_single_hash_payload_keeps_its_parent() -> None:
    assert checkpoint_of([H[3]], None) == Checkpoint(H[3], None)
    assert checkpoint_of([H[7]], H[3]) == Checkpoint(H[7], H[3])


def test_cutting_twice_changes_nothing() -> None:
    # A lookup of a chunk already recorded hands the cut payload back in.
    once = checkpoint_of([H[5], H[7]], H[3])
    assert checkpoint_of([once.block_hash], once.parent_block_hash) == once


def test_empty_payload_is_refused() -> None:
    with pytest.raises(GeometryError):
        checkpoint_of([], H[0])
