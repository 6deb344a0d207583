"""Residency snapshots (docs/contract.md, Snapshots): one worker rank's
residency at an exact position of the bus, for consumers that start late.

A `RankSnapshot` is what a consumer that watched the rank from the start would
hold after the message it names (`through`: that message's Nats-Msg-Id; in
JetStream mode also `stream_seq`, its stream sequence): every group's kind,
shape and copies per medium and layer, and the view's own counters. A consumer
applies the snapshot, then only what came after that message.

Where they come from:

- the bridge's `kv-bridge-snapshot` NATS service, at `snapshot_subject(prefix,
  token)` (outside `<prefix>.>`, so neither the stream nor `<prefix>.>`
  subscribers see requests). A request is a `SnapshotRequest` as JSON (or
  empty for part 0); each answer one `SnapshotPart`, msgpack, which carries a
  slice of the encoded snapshot, so no answer exceeds the server's
  max_payload. Part 0 says how many parts there are and the snapshot's `id`;
  the other parts are asked for by that id while the bridge keeps it.
- in JetStream mode, a key-value bucket (`--snapshot-bucket`, default
  `kv_snapshots`): per rank a head under `snapshot_key(token)` (a
  `SnapshotHead`, JSON) naming the snapshot and its parts, and the parts under
  `part_key(token, slot, n)`; written in one of two slots in turn, so a reader
  that races a writer sees a head whose parts are all there, or retries.

Snapshots are always msgpack: hashes may be bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import Any, Final

import msgspec

from bridge.contract.events import BlockHash
from bridge.contract.identity import reply_copy
from bridge.contract.registry import KV_GONE, KV_OPERATION, registry_key
from bridge.contract.subjects import worker_token

SNAPSHOT_VERSION: Final = 1
# Subjects of the snapshot service: `kvbridge.snapshot.<prefix>.<worker token>`.
SNAPSHOT_ROOT: Final = "kvbridge.snapshot"
SNAPSHOT_SERVICE: Final = "kv-bridge-snapshot"
DEFAULT_SNAPSHOT_BUCKET: Final = "kv_snapshots"
# Room left in each part for the SnapshotPart's own fields and NATS headers.
PART_OVERHEAD: Final = 1024


class TierState(msgspec.Struct, gc=False, omit_defaults=True):
    """One medium of one group: hashes per layer, with their copy counts
    (`*_copies` is empty when every count is 1, else one count per hash)."""

    medium: str
    trusted: list[BlockHash] = []
    trusted_copies: list[int] = []
    suspect: list[BlockHash] = []
    suspect_copies: list[int] = []
    placeholders: list[BlockHash] = []
    placeholder_copies: list[int] = []


class GroupState(msgspec.Struct, gc=False, omit_defaults=True):
    group: int
    kind: str
    family: str
    block_size: int = 0
    window: int | None = None
    # (seq, part, chunk) of the last group message applied in the epoch.
    last_position: tuple[int, int, int] | None = None
    stored: int = 0
    removed: int = 0
    unknown_removals: int = 0
    tiers: list[TierState] = []


class RankSnapshot(msgspec.Struct, gc=False, omit_defaults=True):
    """One worker rank's residency after the message `through`.

    `complete` is False when the bridge itself does not know the rank's whole
    history since its epoch began (it resumed from a stream that no longer
    held it, with no snapshot to start from): a consumer marks the view stale
    until a record that resets it (a fresh start, a restart)."""

    v: int
    worker: str
    dp_rank: int
    epoch: int
    taken_at: float
    complete: bool = True
    through: str = ""
    stream_seq: int = 0
    topic: str = ""
    last_seq: int | None = None
    last_ts: float = 0.0
    watching: bool = True
    messages: int = 0
    gaps: int = 0
    restarts: int = 0
    clears: int = 0
    duplicates_ignored: int = 0
    old_epoch_ignored: int = 0
    lost: list[tuple[int, int]] = []
    groups: list[GroupState] = []


class SnapshotRequest(msgspec.Struct, omit_defaults=True):
    """Part 0 of a new snapshot (no id), or part `part` of snapshot `id`."""

    id: str = ""
    part: int = 0


class SnapshotPart(msgspec.Struct, gc=False):
    """Slice `part` of `parts` of the encoded RankSnapshot `id`."""

    v: int
    worker: str
    dp_rank: int
    id: str
    part: int
    parts: int
    data: bytes


class SnapshotHead(msgspec.Struct, omit_defaults=True):
    """A bucket's pointer to one rank's latest snapshot: its parts sit under
    `part_key(token, slot, n)` for n < parts, each a SnapshotPart of `id`."""

    v: int
    worker: str
    dp_rank: int
    id: str
    slot: str
    parts: int
    epoch: int
    stream_seq: int
    taken_at: float
    bytes: int


_encode = msgspec.msgpack.Encoder().encode
_snapshot = msgspec.msgpack.Decoder(RankSnapshot)
_part = msgspec.msgpack.Decoder(SnapshotPart)
_head_encode = msgspec.json.Encoder().encode
_head = msgspec.json.Decoder(SnapshotHead)
_request = msgspec.json.Decoder(SnapshotRequest)
_request_encode = msgspec.json.Encoder().encode
# What a reader takes at most: a snapshot's parts and their bytes (a
# million resident blocks of int hashes is about 10 MB).
MAX_PARTS: Final = 1 << 16
MAX_SNAPSHOT_BYTES: Final = 1 << 30


def snapshot_subject(prefix: str, worker: str, dp_rank: int) -> str:
    return f"{SNAPSHOT_ROOT}.{prefix}.{worker_token(worker, dp_rank)}"


def snapshot_key(worker: str, dp_rank: int) -> str:
    """The bucket key of a rank's head: its subject token, `~` written `=`
    (the registry's mapping, per rank)."""
    return registry_key(worker) if dp_rank == 0 else worker_token(worker, dp_rank).replace("~", "=")


def part_key(head_key: str, slot: str, n: int) -> str:
    return f"{head_key}.{slot}.{n}"


def encode_snapshot(snap: RankSnapshot) -> bytes:
    return _encode(snap)


# The list fields of a tier: the ones that grow with what a rank holds.
_TIER_LISTS: Final = ("trusted", "trusted_copies", "suspect", "suspect_copies", "placeholders", "placeholder_copies")


def encode_snapshot_steps(snap: RankSnapshot, step: int = 4096) -> Generator[None, None, bytes]:
    """`encode_snapshot`'s bytes, exactly, a piece at a time: yields after
    every `step` items of a long list and after each tier, and
    returns the encoding, so that a caller on an event loop can encode a
    large snapshot between its other work (in one call, a few MB of hashes
    hold it for milliseconds). The pieces are encoded alone and joined as
    `msgspec.Raw`, which msgspec writes as they are."""
    groups: list[Any] = []
    for g in snap.groups:
        tiers: list[Any] = []
        for t in g.tiers:
            long: dict[str, Any] = {}
            for name in _TIER_LISTS:
                items = getattr(t, name)
                if len(items) > step:
                    long[name] = yield from _array_steps(items, step)
            tiers.append(msgspec.Raw(_encode(msgspec.structs.replace(t, **long) if long else t)))
            yield
        groups.append(msgspec.structs.replace(g, tiers=tiers))
    return _encode(msgspec.structs.replace(snap, groups=groups))


def _array_head(n: int) -> bytes:
    """msgpack's header of an array of `n` items."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _array_steps(items: Sequence[Any], step: int) -> Generator[None, None, msgspec.Raw]:
    """A list's msgpack encoding, `step` items at a time: its header, then
    each slice's encoding without the slice's own header."""
    parts = [_array_head(len(items))]
    for k in range(0, len(items), step):
        piece = items[k : k + step]
        parts.append(_encode(piece)[len(_array_head(len(piece))):])
        yield
    return msgspec.Raw(b"".join(parts))


def decode_snapshot(data: bytes) -> RankSnapshot:
    """Raises msgspec.DecodeError (or ValidationError) on anything else."""
    return _snapshot.decode(data)


def split(snap: RankSnapshot, data: bytes, snap_id: str, max_part: int) -> list[SnapshotPart]:
    """The encoded snapshot `data` in parts of at most `max_part` bytes of data."""
    step = max(1, max_part)
    chunks = [data[i : i + step] for i in range(0, len(data), step)] or [b""]
    return [SnapshotPart(SNAPSHOT_VERSION, snap.worker, snap.dp_rank, snap_id, n, len(chunks), chunk)
            for n, chunk in enumerate(chunks)]


def encode_part(part: SnapshotPart) -> bytes:
    return _encode(part)


def decode_part(data: bytes) -> SnapshotPart:
    return _part.decode(data)


def join(parts: list[SnapshotPart]) -> RankSnapshot:
    """The snapshot from all its parts, in any order; raises ValueError when
    parts are missing or belong to different snapshots."""
    if not parts:
        raise ValueError("no parts")
    first = parts[0]
    ordered = sorted(parts, key=lambda p: p.part)
    if any(p.id != first.id or p.parts != first.parts for p in parts) or \
            [p.part for p in ordered] != list(range(first.parts)):
        raise ValueError(f"snapshot {first.id}: parts missing or mixed")
    snap = decode_snapshot(b"".join(p.data for p in ordered))
    if snap.v != SNAPSHOT_VERSION:
        # A later version may mean something this reader does not know.
        raise ValueError(f"snapshot version {snap.v}, this reader knows {SNAPSHOT_VERSION}")
    return snap


def encode_head(head: SnapshotHead) -> bytes:
    return _head_encode(head)


def decode_head(data: bytes) -> SnapshotHead:
    return _head.decode(data)


def decode_request(data: bytes) -> SnapshotRequest:
    """An empty request asks for part 0 of a new snapshot."""
    return _request.decode(data) if data.strip() else SnapshotRequest()


class SnapshotMissing(msgspec.Struct, frozen=True):
    """A consumer's bootstrap could not have this rank's snapshot (`reason`):
    its view is built from the messages alone and marked stale."""

    worker: str
    dp_rank: int
    reason: str


class SnapshotUnavailable(Exception):
    """No usable snapshot: none kept, parts missing, or not decodable."""


class CopiedValue(SnapshotUnavailable):
    """A bucket key holds a copy of another message, stored there by
    someone's read (bridge.contract.identity.reply_copy), not the bridge's write."""


def stored_value(key: str, headers: Mapping[str, str] | None, data: bytes | None) -> bytes | None:
    """A snapshot bucket key's value as stored (`headers`: the stored ones,
    not a direct get's): None for a deleted key; CopiedValue for a copy."""
    if reply_copy(headers):
        raise CopiedValue(f"bucket key {key[:200]} holds a copy another user's read stored there (refused)")
    if headers and headers.get(KV_OPERATION) in KV_GONE:
        return None
    return data


def encode_request(req: SnapshotRequest) -> bytes:
    return _request_encode(req)


async def fetch_parts(request: Callable[[bytes], Awaitable[bytes]],
                      max_bytes: int = MAX_SNAPSHOT_BYTES) -> RankSnapshot:
    """A snapshot from the service: part 0, then the rest by its id.
    `request` sends one request and returns the answer's data, raising
    SnapshotUnavailable when the service answers with an error."""
    first = _checked(decode_part, await request(b""))
    if not 0 < first.parts <= MAX_PARTS or first.parts * len(first.data) > max_bytes * 2:
        raise SnapshotUnavailable(f"snapshot {first.id}: {first.parts} parts is out of bounds")
    parts = [first]
    size = len(first.data)
    for n in range(1, first.parts):
        part = _checked(decode_part, await request(encode_request(SnapshotRequest(first.id, n))))
        size += len(part.data)
        if size > max_bytes:
            raise SnapshotUnavailable(f"snapshot {first.id} is over {max_bytes} bytes")
        parts.append(part)
    return _checked(join, parts)


async def read_bucket(get: Callable[[str], Awaitable[bytes | None]], worker: str, dp_rank: int, *,
                      tries: int = 3, max_bytes: int = MAX_SNAPSHOT_BYTES) -> tuple[SnapshotHead, RankSnapshot] | None:
    """The rank's latest snapshot in a bucket, with its head; None when the
    bucket has none. `get(key)` returns a key's value or None. A head whose
    parts were overwritten meanwhile (a writer two snapshots on) is read again."""
    key = snapshot_key(worker, dp_rank)
    for _ in range(tries):
        raw = await get(key)
        if raw is None:
            return None
        head = _checked(decode_head, raw)
        if not 0 < head.parts <= MAX_PARTS or head.bytes > max_bytes:
            raise SnapshotUnavailable(f"bucket head {key}: {head.parts} parts, {head.bytes} bytes: out of bounds")
        parts = []
        for n in range(head.parts):
            data = await get(part_key(key, head.slot, n))
            part = None if data is None else _checked(decode_part, data)
            if part is None or part.id != head.id:
                break
            parts.append(part)
        else:
            return head, _checked(join, parts)
    raise SnapshotUnavailable(f"bucket snapshot {key} kept changing while it was read")


def _checked(fn: Callable[..., Any], arg: Any) -> Any:
    try:
        return fn(arg)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise SnapshotUnavailable(f"undecodable snapshot data: {str(exc)[:200]}") from None
