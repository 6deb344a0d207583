"""Pre-generated traffic in vLLM 0.33.0's wire format, shared by every mode.

`HybridWorkload` writes `KVEventBatch` payloads byte for byte as vLLM encodes
them (array-like `[ts, events]`, tagged-map events, bytes hashes) for a hybrid
model: a full-attention group 0, a sliding-window group 1, a mamba group 2,
with evictions and offload-tier stores, in the shapes a real engine sends
(`engine_shapes`: window hashes that skip null blocks, mamba stores with no
hash, `extra_keys` of None). One pool of payloads per batch size is
generated once (cached under bench/results/) and cycled; the publisher stamps
the `ts` field at send time, so latency runs from vLLM's publish.

`encoding="array"` writes the same events as vLLM 0.9.0 through 0.23.0 encoded
them: each event a msgpack array `[tag, field, ...]` in the one positional order
those releases share, trailing defaults left off.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import msgspec

from bridge.apps.demo.workload import MAMBA, WINDOW, HybridWorkload
from bridge.contract import BlockRemoved, BlockStored, KVEventBatch

# `[ts, events]` or `[ts, events, rank]`: a fixarray header, then msgspec's float64 (0xcb + 8 bytes).
TS_OFFSET = 2
_TS = struct.Struct(">d")
FORMAT_VERSION = 3
ENCODINGS = ("map", "array")


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


def as_array_form(payload: bytes, decode: msgspec.msgpack.Decoder) -> bytes:
    """A map-form payload re-encoded as an array-event release would send it."""
    batch: KVEventBatch = decode.decode(payload)
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            events.append(_ArrayStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
                                       e.medium, e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
                                       e.kv_cache_spec_sliding_window))
        elif isinstance(e, BlockRemoved):
            events.append(_ArrayRemoved(e.block_hashes, e.medium, e.group_idx))
        else:
            events.append(_ArrayCleared())
    return msgspec.msgpack.encode(_ArrayBatch(batch.ts, events, batch.data_parallel_rank))


class Pool(msgspec.Struct, array_like=True):
    size: int  # events per batch
    payloads: list[bytes]
    events: list[int]  # vLLM events per payload
    deliverable: list[int]  # events kv-bridge forwards (window placeholders are dropped by design)


def _deliverable(payload: bytes, decode: msgspec.msgpack.Decoder) -> tuple[int, int]:
    batch: KVEventBatch = decode.decode(payload)  # the map form: counted before any conversion
    # kv-bridge drops, by design, window placeholders and state stores that name no position
    dropped = sum(
        1 for e in batch.events if type(e) is BlockStored and (
            (e.group_idx == WINDOW and e.block_size == 0) or (e.group_idx == MAMBA and not e.block_hashes))
    )
    return len(batch.events), len(batch.events) - dropped


def generate(sizes: tuple[int, ...], pool_events: int, seed: int = 7, encoding: str = "map") -> dict[int, Pool]:
    decode = msgspec.msgpack.Decoder(KVEventBatch)
    pools: dict[int, Pool] = {}
    for size in sizes:
        workload = HybridWorkload(seed=seed + size, engine_shapes=True)
        payloads = [workload.batch(size) for _ in range(max(4, pool_events // size))]
        counts = [_deliverable(p, decode) for p in payloads]
        if encoding == "array":
            payloads = [as_array_form(p, decode) for p in payloads]
        for p in payloads:
            check_layout(p)
        pools[size] = Pool(size, payloads, [c[0] for c in counts], [c[1] for c in counts])
    return pools


def cached(sizes: tuple[int, ...], pool_events: int, cache_dir: Path, seed: int = 7,
           encoding: str = "map") -> tuple[Path, dict[int, Pool]]:
    """The pools, from the cache file when one with the same parameters exists."""
    key = hashlib.sha256(repr((FORMAT_VERSION, sizes, pool_events, seed, encoding)).encode()).hexdigest()[:12]
    path = cache_dir / f"traffic-{key}.msgpack"
    if path.is_file():
        try:
            return path, load(path)
        except (msgspec.DecodeError, OSError):
            pass
    pools = generate(sizes, pool_events, seed, encoding)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.msgpack.encode(list(pools.values())))
    tmp.replace(path)
    return path, pools


def load(path: Path) -> dict[int, Pool]:
    pools = msgspec.msgpack.decode(path.read_bytes(), type=list[Pool])
    return {p.size: p for p in pools}


def check_layout(payload: bytes) -> None:
    if payload[0] not in (0x92, 0x93) or payload[1] != 0xCB:
        raise ValueError("payload is not [float64 ts, events, ...]: cannot stamp ts in place")


def stamp(buf: bytearray, ts: float) -> None:
    """Overwrite the batch `ts` in an encoded payload (same length, same bytes otherwise)."""
    _TS.pack_into(buf, TS_OFFSET, ts)
