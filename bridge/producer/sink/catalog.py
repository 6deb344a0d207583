"""What the worker's registry entry says about groups and seqs, learned from the
batches on their way to NATS, i.e. from the same headers and payloads consumers
see, not from the pipeline's internals."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import msgspec

from bridge.contract import (
    DEFAULT_FORMAT,
    DEFAULT_TENANT,
    HDR_FAMILY,
    HDR_FORMAT,
    HDR_KIND,
    HDR_SEQ,
    MAX_GROUP_ID,
    OTHER,
    UNKNOWN_KIND,
    WINDOW,
    WORKER_TOKEN,
    GroupInfo,
    RankInfo,
    WorkerEntry,
    decoder_for,
)
from bridge.producer.sink.queue import OutBatch

# While a group's block size (or window) is unknown, decode one message in this
# many to learn it; the rest of the time the catalog reads headers only.
_SAMPLE_EVERY: Final = 16


class _StoredSizes(msgspec.Struct, tag="BlockStored", gc=False):
    """What the catalog reads of a store; its hashes and tokens are skipped
    unread, so sampling a large message costs no objects per hash."""

    block_size: int = 0
    kv_cache_spec_sliding_window: int | None = None
    placeholder: bool = False


class _Removed(msgspec.Struct, tag="BlockRemoved", gc=False):
    pass


class _SizesOnly(msgspec.Struct, gc=False):
    """A GroupMessage as the catalog reads it."""

    events: list[_StoredSizes | _Removed]


class _RankSeen:
    __slots__ = ("epoch", "last_seq")

    def __init__(self) -> None:
        self.epoch = 0
        self.last_seq: int | None = None


class GroupCatalog:
    """Per batch: its rank, epoch and seq; per message a header read until its
    group is known, and a payload decoded only (and only sometimes) while a
    group's block size or window is unknown. Groups are the pipelines' valid ids
    (0..MAX_GROUP_ID): the tables keyed by them stay bounded whatever a
    publisher sends."""

    def __init__(self) -> None:
        self._groups: dict[int, GroupInfo] = {}
        self._ranks: dict[int, _RankSeen] = {}
        self._misses: dict[int, int] = {}
        self._decoders: dict[str, Any] = {}
        # subject → the kind its group was fully learned with: nothing more to read.
        self._settled: dict[str, str] = {}

    def observe(self, batch: OutBatch) -> None:
        """Learns from one batch the bridge hands to NATS; call it with every
        batch as it is queued, in order."""
        seen = self._ranks.get(batch.dp_rank)
        if seen is None:
            seen = self._ranks[batch.dp_rank] = _RankSeen()
        if batch.epoch != seen.epoch:
            seen.epoch, seen.last_seq = batch.epoch, None
        if batch.seq >= 0:
            self._saw_seq(seen, batch.seq)
        settled = self._settled
        for out in batch.messages:
            headers = out.headers
            if out.family == WORKER_TOKEN:
                # Records tie to a seq only through their header (stop, cleared, resumed start).
                seq_text = headers.get(HDR_SEQ)
                if seq_text is not None:
                    self._saw_seq(seen, int(seq_text))
            elif settled.get(out.subject) != headers.get(HDR_KIND):
                self._learn_group(out.subject, headers, out.payload)

    @staticmethod
    def _saw_seq(seen: _RankSeen, seq: int) -> None:
        if seen.last_seq is None or seq > seen.last_seq:
            seen.last_seq = seq

    def _learn_group(self, subject: str, headers: dict[str, str], payload: bytes) -> None:
        group = int(subject.rpartition(".")[2])
        if not 0 <= group <= MAX_GROUP_ID:
            return
        kind = headers.get(HDR_KIND, UNKNOWN_KIND)
        family = headers.get(HDR_FAMILY, OTHER)
        info = self._groups.get(group)
        if info is None or (kind != info.kind and kind != UNKNOWN_KIND):
            info = self._groups[group] = GroupInfo(group, kind, family)
        complete = info.block_size > 0 and (info.family != WINDOW or info.sliding_window is not None)
        if complete:
            self._settled[subject] = kind
            return
        misses = self._misses.get(group, 0)
        self._misses[group] = misses + 1
        if misses % _SAMPLE_EVERY == 0:
            self._learn_sizes(info, headers.get(HDR_FORMAT, DEFAULT_FORMAT), payload)

    def _learn_sizes(self, info: GroupInfo, fmt: str, payload: bytes) -> None:
        decoder = self._decoders.get(fmt)
        if decoder is None:
            decoder = self._decoders[fmt] = decoder_for(fmt, _SizesOnly)
        try:
            msg: _SizesOnly = decoder.decode(payload)
        except (msgspec.DecodeError, ValueError):
            return
        for event in msg.events:
            if type(event) is _StoredSizes and not event.placeholder:
                if event.block_size > 0 and not info.block_size:
                    info.block_size = event.block_size
                if event.kv_cache_spec_sliding_window and info.sliding_window is None:
                    info.sliding_window = event.kv_cache_spec_sliding_window

    def entry(
        self,
        *,
        worker: str,
        topic: str,
        subject_prefix: str,
        ranks: Iterable[int],
        started_at: float,
        heartbeat_interval: float,
        model: str = "",
        tenant: str = DEFAULT_TENANT,
    ) -> WorkerEntry:
        """The worker's registry entry as the catalog knows it now."""
        wanted = sorted(set(ranks) | set(self._ranks))
        rank_infos = []
        for rank in wanted:
            seen = self._ranks.get(rank)
            rank_infos.append(RankInfo(rank, seen.epoch, seen.last_seq) if seen else RankInfo(rank))
        groups = [msgspec.structs.replace(g) for _, g in sorted(self._groups.items())]
        return WorkerEntry(
            worker=worker, topic=topic, model=model, tenant=tenant, subject_prefix=subject_prefix, ranks=rank_infos,
            groups=groups, started_at=started_at, heartbeat_interval=heartbeat_interval,
        )
