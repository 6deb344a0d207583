"""The NATS contract, v1: what every message on `<prefix>.>` is.

Producers (the bridge) and consumers (`bridge.client`, `tail`, `watch`) share these
structs, so the contract has one definition. Events keep vLLM's own shape
(`BlockStored` / `BlockRemoved` tagged maps) so anyone who reads vLLM's events
reads ours.
"""

from __future__ import annotations

from typing import Final, Literal, Union

import msgspec

from bridge.contract.events import BlockRemoved, BlockStored

SCHEMA_VERSION: Final = 1

# Headers, so routers can filter without decoding the payload.
HDR_MSG_ID: Final = "Nats-Msg-Id"
HDR_KIND: Final = "Kvb-Kind"
HDR_FAMILY: Final = "Kvb-Family"
HDR_SEQ: Final = "Kvb-Seq"
HDR_EPOCH: Final = "Kvb-Epoch"
HDR_FORMAT: Final = "Kvb-Format"
HDR_RECORD: Final = "Kvb-Record"

KindSource = Literal["event", "learned", "pinned", "legacy", "unknown"]
RecordType = Literal["start", "stop", "cleared", "restart", "gap"]

GroupEvent = Union[BlockStored, BlockRemoved]


class GroupMessage(msgspec.Struct, gc=False):
    """One vLLM batch's slice for one kv_cache_group, events in batch order.

    A group's first slice of an epoch always goes out: when nothing in it
    names a position, its one event is the group's shape store, a BlockStored
    with no hash that stores nothing (docs/contract.md, "A group's first
    message"), so consumers know every group from its first batch."""

    v: int
    worker: str
    dp_rank: int
    epoch: int
    seq: int
    ts: float
    group: int
    kind: str
    family: str
    kind_source: KindSource
    events: list[GroupEvent]
    topic: str = ""
    # >0 only when an AllBlocksCleared split the batch: the slice after the n-th clear.
    part: int = 0
    # When the bridge received the batch (its clock), for lag.
    bridge_ts: float = 0.0
    # A slice over the NATS server's max_payload goes as `chunks` messages,
    # events split in order; `chunk` numbers them from 0.
    chunk: int = 0
    chunks: int = 1


class WorkerRecord(msgspec.Struct, gc=False, omit_defaults=True):
    """A worker-level fact on `<prefix>.<worker>.worker`.

    start/stop: the bridge began or ended watching this worker and rank; a start
      with reason "fresh" means consumers forget the worker+rank's view (the
      bridge replays vLLM's buffer next), "resumed" that it continues the epoch.
    cleared: vLLM's AllBlocksCleared at `seq`; every group of the worker is empty.
    restart: seq went back; a new vLLM process (new `epoch`); forget all residency.
    gap: batches `gap_from..gap_to` (inclusive) are lost; the worker's view is stale.
    """

    v: int
    worker: str
    dp_rank: int
    epoch: int
    type: RecordType
    ts: float
    seq: int | None = None
    gap_from: int | None = None
    gap_to: int | None = None
    reason: str | None = None
    topic: str = ""
    bridge_version: str = ""
    # vLLM's timestamp of batch `seq` (stop, cleared): a resuming bridge compares
    # it with what vLLM replays to tell the same process from a new one.
    batch_ts: float | None = None
