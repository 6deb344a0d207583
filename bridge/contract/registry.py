"""The worker registry's entries: one JetStream key-value entry per worker, kept
fresh by heartbeats, so consumers can list workers and tell live ones from dead
ones (docs/contract.md, Worker registry).

Bucket: `--registry-bucket` (default `kv_workers`). Key: the worker's subject
token (`worker_token(worker, 0)`) with `~` written as `=`, because KV keys allow
`[-/_=.A-Za-z0-9]` and the token alphabet never holds `=`, so the mapping stays
injective. Value: a `WorkerEntry` as JSON, so `nats kv get kv_workers <key>` is
readable.

`model` is what the worker serves (the bridge's `--model`, or vLLM's
`/v1/models`; empty: not known) and `tenant` whom it serves (`--tenant`).
Both are the worker's own say about itself, trusted as its key is: an entry
written before `tenant` existed decodes as tenant `default`.

A reader calls a worker dead when `now - heartbeat_ts > dead_after ×
heartbeat_interval` (the entry carries its own interval, so readers need no
configuration), and stopped when the bridge wrote `state="stopped"` on exit.
"""

from __future__ import annotations

import time
from typing import Final, Literal

import msgspec

from bridge.contract.subjects import worker_token

DEFAULT_BUCKET: Final = "kv_workers"
# The header a key-value bucket (this one, the snapshot bucket) marks a
# deleted or purged key with, and its values that say so.
KV_OPERATION: Final = "KV-Operation"
KV_GONE: Final = frozenset({"DEL", "PURGE"})
REGISTRY_VERSION: Final = 1
DEFAULT_TENANT: Final = "default"
DEFAULT_DEAD_AFTER: Final = 3.0

Liveness = Literal["alive", "dead", "stopped"]


class GroupInfo(msgspec.Struct, omit_defaults=True):
    group: int
    kind: str
    family: str
    block_size: int = 0  # tokens per block; 0 until a store names it
    sliding_window: int | None = None  # tokens, window groups only


class RankInfo(msgspec.Struct, omit_defaults=True):
    dp_rank: int
    epoch: int = 0
    # Last vLLM batch seq this bridge handed to NATS for the rank (None: none yet).
    last_seq: int | None = None


class WorkerEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = REGISTRY_VERSION
    worker: str
    topic: str = ""
    model: str = ""
    tenant: str = DEFAULT_TENANT  # omitted on the wire when default, as entries before it were
    subject_prefix: str = "kv"
    ranks: list[RankInfo]
    groups: list[GroupInfo]
    bridge_version: str = ""
    started_at: float
    heartbeat_ts: float = 0.0
    heartbeat_interval: float
    state: Literal["running", "stopped"] = "running"


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(WorkerEntry).decode


def registry_key(worker: str) -> str:
    return worker_token(worker, 0).replace("~", "=")


def encode_entry(entry: WorkerEntry) -> bytes:
    return _encode(entry)


def decode_entry(data: bytes) -> WorkerEntry:
    """Raises msgspec.DecodeError on anything that is not an entry."""
    return _decode(data)


def liveness(entry: WorkerEntry, now: float | None = None, dead_after: float = DEFAULT_DEAD_AFTER) -> Liveness:
    if entry.state == "stopped":
        return "stopped"
    now = time.time() if now is None else now
    return "dead" if now - entry.heartbeat_ts > dead_after * entry.heartbeat_interval else "alive"
