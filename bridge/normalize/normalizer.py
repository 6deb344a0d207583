"""One decoded vLLM batch → per-group slices with kind and family, plus worker records.

Pure logic, no I/O: the stream task feeds it batches in seq order and hands what
comes out to the sink.
"""

from __future__ import annotations

from dataclasses import dataclass

from bridge.contract import (
    SCHEMA_VERSION,
    GroupEvent,
    GroupMessage,
    KindSource,
    WorkerRecord,
)
from bridge.decode.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, empty_tokens
from bridge.normalize.kinds import (
    LEGACY_KIND,
    STATE,
    UNKNOWN_KIND,
    WINDOW,
    clean_kind,
    family_of,
)


@dataclass(slots=True)
class StreamIdentity:
    worker: str
    dp_rank: int
    topic: str
    epoch: int


class Tally(dict[str, int]):
    """A counter as cheap to make as a dict (one per batch): missing keys count 0."""

    __slots__ = ()

    def __missing__(self, key: str) -> int:
        return 0


class NormalizeStats:
    """What normalization did to one batch, for the metrics."""

    __slots__ = ("dropped", "transformed")

    def __init__(self) -> None:
        self.dropped: Tally = Tally()
        self.transformed: Tally = Tally()


class KindBook:
    """Kinds per group for one vLLM process: pinned by the operator, else
    learned from the first store that names one. Forgotten on restart."""

    def __init__(self, pinned: dict[int, str]) -> None:
        self._pinned = dict(pinned)
        self._learned: dict[int, str] = {}

    def learn(self, group: int, kind: str) -> None:
        if group not in self._pinned and group not in self._learned:
            self._learned[group] = kind

    def resolve(self, group: int, legacy: bool) -> tuple[str, KindSource]:
        pinned = self._pinned.get(group)
        if pinned is not None:
            return pinned, "pinned"
        learned = self._learned.get(group)
        if learned is not None:
            return learned, "learned"
        if legacy:
            return LEGACY_KIND, "legacy"
        return UNKNOWN_KIND, "unknown"

    def forget(self) -> None:
        self._learned.clear()

    def known(self) -> dict[int, str]:
        return {**self._learned, **self._pinned}


class Normalizer:
    def __init__(self, kinds: KindBook, keep_placeholders: bool) -> None:
        self.kinds = kinds
        self._keep_placeholders = keep_placeholders
        # Raw kinds from the wire are few: clean each once.
        self._clean: dict[str, str] = {}

    def normalize(
        self,
        ident: StreamIdentity,
        seq: int,
        ts: float,
        events: list[Event],
        bridge_ts: float,
        stats: NormalizeStats,
    ) -> list[GroupMessage | WorkerRecord]:
        out: list[GroupMessage | WorkerRecord] = []
        # Per group (None counts as 0), in first-seen order: the events, and the
        # kind the slice's first store names. Only group 0 can be legacy (no
        # group, no kind on any of its events).
        slices: dict[int, list[GroupEvent]] = {}
        explicit: dict[int, str] = {}
        group0_named = False
        part = 0
        removed = BlockRemoved
        for event in events:
            cls = type(event)
            if cls is AllBlocksCleared:
                self._flush(ident, seq, ts, bridge_ts, part, slices, explicit, group0_named, stats, out)
                slices = {}
                explicit = {}
                group0_named = False
                part += 1
                out.append(
                    WorkerRecord(
                        v=SCHEMA_VERSION, worker=ident.worker, dp_rank=ident.dp_rank,
                        epoch=ident.epoch, type="cleared", ts=ts, seq=seq, topic=ident.topic,
                    )
                )
                continue
            key = event.group_idx  # type: ignore[union-attr]
            if key is None:
                key = 0
            elif key == 0:
                group0_named = True
            bucket = slices.get(key)
            if bucket is None:
                bucket = slices[key] = []
            bucket.append(event)  # type: ignore[arg-type]
            if cls is not removed and key not in explicit:
                raw = event.kv_cache_spec_kind  # type: ignore[union-attr]
                if raw is not None:
                    kind = self._clean.get(raw)
                    if kind is None:
                        kind = self._clean[raw] = clean_kind(raw)
                    explicit[key] = kind
                    self.kinds.learn(key, kind)
        if slices:
            self._flush(ident, seq, ts, bridge_ts, part, slices, explicit, group0_named, stats, out)
        return out

    def _flush(
        self,
        ident: StreamIdentity,
        seq: int,
        ts: float,
        bridge_ts: float,
        part: int,
        slices: dict[int, list[GroupEvent]],
        explicit: dict[int, str],
        group0_named: bool,
        stats: NormalizeStats,
        out: list[GroupMessage | WorkerRecord],
    ) -> None:
        for group, events in slices.items():
            named = explicit.get(group)
            legacy = group == 0 and not group0_named and named is None
            kind, source = self.kinds.resolve(group, legacy)
            if source == "learned" and named == kind:
                source = "event"
            family = family_of(kind)
            if family == STATE:
                events = self._reduce_state(events, stats)
            elif family == WINDOW:
                events = self._handle_placeholders(events, stats)
            if source == "unknown":
                stats.transformed["unknown_kind"] += len(events)
            if not events:
                continue
            out.append(
                GroupMessage(
                    v=SCHEMA_VERSION, worker=ident.worker, dp_rank=ident.dp_rank,
                    epoch=ident.epoch, seq=seq, ts=ts, group=group, kind=kind, family=family,
                    kind_source=source, events=events, topic=ident.topic, part=part,
                    bridge_ts=bridge_ts,
                )
            )

    @staticmethod
    def _reduce_state(events: list[GroupEvent], stats: NormalizeStats) -> list[GroupEvent]:
        """A recurrent checkpoint is valid only at its one hash: a multi-hash
        store (an older or unpatched publisher) becomes its last hash, with the
        hash before it as parent, whatever else it said."""
        result: list[GroupEvent] = []
        for event in events:
            if isinstance(event, BlockStored) and len(event.block_hashes) > 1:
                hashes = event.block_hashes
                cls = type(event)
                result.append(
                    cls(
                        block_hashes=[hashes[-1]], parent_block_hash=hashes[-2], token_ids=empty_tokens(cls),  # type: ignore[arg-type]  # Raw for a relayed store
                        block_size=event.block_size, lora_id=event.lora_id, medium=event.medium,
                        lora_name=event.lora_name, group_idx=event.group_idx,
                        kv_cache_spec_kind=event.kv_cache_spec_kind, locality=event.locality,
                        ownership=event.ownership, session_id=event.session_id,
                    )
                )
                stats.transformed["state_reduced"] += 1
            else:
                result.append(event)
        return result

    def _handle_placeholders(self, events: list[GroupEvent], stats: NormalizeStats) -> list[GroupEvent]:
        """Window placeholders (block_size=0) name no position: drop, or flag."""
        result: list[GroupEvent] = []
        for event in events:
            if not isinstance(event, BlockStored):
                pass
            elif event.block_size == 0:
                if not self._keep_placeholders:
                    stats.dropped["window_placeholder"] += 1
                    continue
                event.placeholder = True
                stats.transformed["placeholder_flagged"] += 1
            else:
                # the flag is the bridge's word, never the publisher's
                event.placeholder = False
            result.append(event)
        return result
