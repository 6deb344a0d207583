"""Contract messages built by hand, for index and query tests."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

from bridge.contract import (
    SCHEMA_VERSION,
    BlockHash,
    BlockRemoved,
    BlockStored,
    GroupMessage,
    KindSource,
    RecordType,
    WorkerRecord,
    family_of,
)
from bridge.residency.hashes import as_int

ATTN, STATE, WIN, OTHER_G = 0, 1, 2, 3
KINDS = {ATTN: "full_attention", STATE: "mamba", WIN: "sliding_window", OTHER_G: "cross_attention"}
BLOCK = 16
WINDOW_TOKENS = 33  # vLLM needs ceil(32 / 16) = 2 blocks before a hit

# Messages built without a seq come in the order they are built, as the bridge
# publishes them (the index takes one at or before its group's last as a copy).
_NEXT_SEQ = itertools.count(1)


def hb(i: int) -> bytes:
    """The i-th test hash, bytes form."""
    return hashlib.sha256(f"block-{i}".encode()).digest()


def hi(i: int) -> int:
    """The same hash in vLLM's int form."""
    return as_int(hb(i))


def stored(hashes: Sequence[BlockHash], *, group: int = ATTN, medium: str = "GPU", block_size: int = BLOCK,
           window: int | None = None, placeholder: bool = False) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=block_size, lora_id=None,
        medium=medium, lora_name=None,
        group_idx=group, kv_cache_spec_kind=KINDS.get(group),
        kv_cache_spec_sliding_window=window if window is not None else (WINDOW_TOKENS if group == WIN else None),
        placeholder=placeholder,
    )


def removed(hashes: Sequence[BlockHash], *, group: int = ATTN, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)


def msg(events: list[BlockStored | BlockRemoved], *, group: int = ATTN, worker: str = "w", rank: int = 0,
        epoch: int = 1, seq: int | None = None, kind: str | None = None, source: KindSource = "event",
        ts: float = 1.0) -> GroupMessage:
    kind = kind or KINDS[group]
    return GroupMessage(
        v=SCHEMA_VERSION, worker=worker, dp_rank=rank, epoch=epoch,
        seq=next(_NEXT_SEQ) if seq is None else seq, ts=ts, group=group, kind=kind,
        family=family_of(kind), kind_source=source, events=events,
    )


def record(type_: RecordType, *, worker: str = "w", rank: int = 0, epoch: int = 1, seq: int | None = None,
           reason: str | None = None, gap: tuple[int, int] | None = None) -> WorkerRecord:
    return WorkerRecord(
        v=SCHEMA_VERSION, worker=worker, dp_rank=rank, epoch=epoch, type=type_, ts=1.0, seq=seq, reason=reason,
        gap_from=gap[0] if gap else None, gap_to=gap[1] if gap else None,
    )
