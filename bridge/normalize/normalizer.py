"""One decoded vLLM batch → per-group slices with kind and family, plus worker records.

Pure logic, no I/O: the stream task feeds it batches in seq order and hands what
comes out to the sink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

from bridge.contract import (
    FAMILY_OF_KIND,
    LEGACY_KIND,
    MAX_GROUP_ID,
    SCHEMA_VERSION,
    STATE,
    UNKNOWN_KIND,
    WINDOW,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    GroupEvent,
    GroupMessage,
    KindSource,
    WorkerRecord,
    clean_kind,
    family_of,
    state_checkpoints,
)
from bridge.decode.wire import EMPTY_RAW_ARRAY, NIL_RAW

# A real batch yields one slice per group, a few groups, rarely split by a
# clear. Past this many messages (slices and clear records) the rest of the
# batch is malformed: a publisher cannot make one frame cost a message per event.
MAX_MESSAGES_PER_BATCH: Final = 256
# A vLLM step stores and evicts about max_num_batched_tokens / block_size
# blocks per group, one event each: this is 32 768 per group of four, 512k
# tokens a step. Past this many stores and removals the rest of the batch is
# malformed, so tiny events (a 14-byte array store leaves as a 100-byte map)
# cannot multiply a frame into hundreds of MiB of messages.
MAX_EVENTS_PER_BATCH: Final = 1 << 17

# Malformed-event reasons the normalizer finds (the decoder has its own).
BAD_GROUP: Final = "bad_group"
TOO_MANY_MESSAGES: Final = "too_many_messages"
TOO_MANY_EVENTS: Final = "too_many_events"



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
    """What normalization did to one batch, for the metrics. `malformed`:
    events rejected (reason → count), `malformed_detail` the first one's why;
    a batch with any is named by a gap."""

    __slots__ = ("dropped", "transformed", "malformed", "malformed_detail")

    def __init__(self) -> None:
        self.dropped: Tally = Tally()
        self.transformed: Tally = Tally()
        self.malformed: Tally = Tally()
        self.malformed_detail = ""

    def reject(self, reason: str, n: int, detail: str) -> None:
        if not self.malformed:
            self.malformed_detail = detail
        self.malformed[reason] += n

    def clear(self) -> None:
        self.dropped.clear()
        self.transformed.clear()
        self.malformed.clear()
        self.malformed_detail = ""


class KindBook:
    """Kinds per group for one vLLM process: pinned by the operator, else
    learned from the first store that names one. Forgotten on restart.

    Keyed by group id, so bounded by MAX_GROUP_ID: the normalizer rejects
    other ids before they get here, and `learn` ignores them anyway."""

    def __init__(self, pinned: dict[int, str]) -> None:
        self._pinned = dict(pinned)
        self._learned: dict[int, str] = {}
        # vLLM 0.20-0.21 send group ids but never a kind: seen a store without
        # one, and never a kind, means such a publisher.
        self._named = False
        self._kindless = False

    def learn(self, group: int, kind: str) -> None:
        self._named = True
        if 0 <= group <= MAX_GROUP_ID and group not in self._pinned and group not in self._learned:
            self._learned[group] = kind

    def saw_kindless_store(self) -> None:
        self._kindless = True

    @property
    def kindless_publisher(self) -> bool:
        """Stores came, none named a kind: group 0 is the legacy full attention."""
        return self._kindless and not self._named

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
        self._named = False
        self._kindless = False

    def known(self) -> dict[int, str]:
        return {**self._learned, **self._pinned}


class Normalizer:
    def __init__(self, kinds: KindBook, keep_placeholders: bool) -> None:
        self.kinds = kinds
        self._keep_placeholders = keep_placeholders
        # vLLM's own kinds, clean already. Any other string from the wire is
        # cleaned where it appears (once per slice) and never kept here, so a
        # publisher inventing kinds cannot grow this table.
        self._clean: dict[str, str] = {kind: kind for kind in FAMILY_OF_KIND}

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
        # kind the slice's first store names. Only group 0 can be legacy.
        slices: dict[int, list[GroupEvent]] = {}
        explicit: dict[int, str] = {}
        group0_named = False
        part = 0
        if len(events) > MAX_EVENTS_PER_BATCH:
            events = self._cut(events, stats)
        # Messages (slices and clear records) this batch may still yield.
        budget = MAX_MESSAGES_PER_BATCH
        # Nothing stored or removed since the last clear: another clear says it again.
        after_clear = False
        kindless = False
        removed = BlockRemoved
        clean = self._clean
        kinds = self.kinds
        for i, event in enumerate(events):
            cls = type(event)
            if cls is AllBlocksCleared:
                if after_clear:
                    stats.dropped["repeated_clear"] += 1
                    continue
                if budget == 0:
                    stats.reject(TOO_MANY_MESSAGES, len(events) - i, f"over {MAX_MESSAGES_PER_BATCH} messages")
                    break
                budget -= 1
                after_clear = True
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
                if key < 0 or key > MAX_GROUP_ID:
                    stats.reject(BAD_GROUP, 1, f"group_idx {key} outside 0..{MAX_GROUP_ID}")
                    continue
                if budget == 0:
                    stats.reject(TOO_MANY_MESSAGES, len(events) - i, f"over {MAX_MESSAGES_PER_BATCH} messages")
                    break
                budget -= 1
                bucket = slices[key] = []
            after_clear = False
            bucket.append(event)  # type: ignore[arg-type]
            if cls is not removed and key not in explicit:
                raw = event.kv_cache_spec_kind  # type: ignore[union-attr]
                if raw is not None:
                    kind = clean.get(raw)
                    if kind is None:
                        kind = clean_kind(raw)
                    explicit[key] = kind
                    kinds.learn(key, kind)
                elif not kindless:
                    kindless = True
                    kinds.saw_kindless_store()
        if slices:
            self._flush(ident, seq, ts, bridge_ts, part, slices, explicit, group0_named, stats, out)
        return out

    @staticmethod
    def _cut(events: list[Event], stats: NormalizeStats) -> list[Event]:
        """The batch up to its MAX_EVENTS_PER_BATCH-th store or removal; the
        rest is rejected. Clears take no room: repeated, they say nothing new."""
        room = MAX_EVENTS_PER_BATCH
        cleared = AllBlocksCleared
        for i, event in enumerate(events):
            if type(event) is not cleared:
                if room == 0:
                    stats.reject(TOO_MANY_EVENTS, len(events) - i, f"over {MAX_EVENTS_PER_BATCH} stores and removals")
                    return events[:i]
                room -= 1
        return events

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
            # Group 0 with no kind is the legacy full attention: events with no
            # group at all (before vLLM 0.20), or a publisher that names groups
            # but never kinds (0.20-0.21).
            legacy = group == 0 and named is None and (not group0_named or self.kinds.kindless_publisher)
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
        """A recurrent checkpoint is valid only at its hash (docs/contract.md, `state`).
        In the GPU tier vLLM lists only blocks that hold state, so every hash is
        a checkpoint. An offload tier holds one state per chunk: a multi-hash
        store there (an older or unpatched publisher) becomes its last hash,
        with the hash before it as parent. A store with no hash names no
        position. Token ids never align with the hashes: they go."""
        result: list[GroupEvent] = []
        raw = msgspec.Raw
        for event in events:
            if isinstance(event, BlockStored):
                hashes = event.block_hashes
                if not hashes:
                    stats.dropped["state_no_hash"] += 1
                    continue
                if len(hashes) > 1:
                    checkpoints = state_checkpoints(event.medium, hashes)
                    if len(checkpoints) < len(hashes):
                        event.block_hashes = checkpoints
                        event.parent_block_hash = hashes[-len(checkpoints) - 1]
                        stats.transformed["state_reduced"] += 1
                # the store is this batch's own: changed in place, like
                # placeholders, and only where there is something to strip
                tokens = event.token_ids
                if tokens.__class__ is raw:
                    if len(tokens) != 1:  # type: ignore[arg-type]  # b"\x90", an empty array, is 1 byte
                        event.token_ids = EMPTY_RAW_ARRAY
                    if event.lookahead_token_ids is not NIL_RAW:
                        event.lookahead_token_ids = NIL_RAW  # type: ignore[assignment]  # RelayBlockStored's default
                else:
                    if tokens:
                        event.token_ids = []
                    if event.lookahead_token_ids is not None:
                        event.lookahead_token_ids = None
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
