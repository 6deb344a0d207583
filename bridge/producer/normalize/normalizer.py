"""One decoded vLLM batch → per-group slices with kind and family, plus worker records.

Pure logic, no I/O: the stream task feeds it batches in seq order and hands what
comes out to the sink.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from operator import length_hint
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
    Event,
    GroupEvent,
    GroupMessage,
    KindSource,
    WorkerRecord,
    clean_kind,
    family_of,
    state_checkpoints,
)
from bridge.producer.decode.wire import EMPTY_RAW_ARRAY, NIL_RAW, RelayBlockStored

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

# Why a state or window slice's stores were dropped (NormalizeStats.dropped).
_DROP_REASON: Final = {STATE: "state_no_hash", WINDOW: "window_placeholder"}

# Remembered slice decisions (Normalizer._decided), past which more are not kept.
MAX_DECISIONS: Final = 4096

# A slice's kind, the source of that kind, and its family.
Decision = tuple[str, KindSource, str]


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
        # Moves whenever an answer of `resolve` or `kindless_publisher` may
        # change: a caller may keep answers for as long as it stays.
        self.generation = 0

    def learn(self, group: int, kind: str) -> None:
        if not self._named:
            self._named = True
            self.generation += 1
        if 0 <= group <= MAX_GROUP_ID and group not in self._pinned and group not in self._learned:
            self._learned[group] = kind
            self.generation += 1

    def saw_kindless_store(self) -> None:
        if not self._kindless:
            self._kindless = True
            self.generation += 1

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
        self.generation += 1

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
        # What a slice resolves to, by (group, the kind it named, legacy):
        # (kind, source, family), as the book answered at `_generation`. The
        # same few groups come in every batch, and asking the book costs more
        # than the rest of a slice's work. Bounded: a publisher may invent kinds.
        self._decided: dict[tuple[int, str | None, bool], Decision] = {}
        self._generation = -1
        # Groups that have had a message since the publisher (re)started: a
        # group's first slice always goes out, so consumers know every group
        # (docs/contract.md, "A group's first message"). Bounded by MAX_GROUP_ID.
        self._met: set[int] = set()

    def restarted(self) -> None:
        """A new publisher process: kinds are learned, and groups met, anew."""
        self.kinds.forget()
        self._met.clear()

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
        # Per group (None counts as 0), in first-seen order, the events. Only
        # group 0 can be legacy. This loop runs per event: whatever can be
        # decided per slice (kinds) or for the rare case (the counts of a
        # rejection) is left out of it.
        slices: dict[int, list[GroupEvent]] = {}
        group0_named = False
        part = 0
        if len(events) > MAX_EVENTS_PER_BATCH:
            events = self._cut(events, stats)
        # Messages (slices and clear records) this batch may still yield.
        budget = MAX_MESSAGES_PER_BATCH
        cleared = AllBlocksCleared
        rest = iter(events)
        for event in rest:
            if event.__class__ is cleared:
                if part and not slices:
                    # a clear came (part > 0), nothing stored or removed since: this says it again
                    stats.dropped["repeated_clear"] += 1
                    continue
                if budget == 0:
                    self._reject_rest(stats, rest)
                    break
                budget -= 1
                self._flush(ident, seq, ts, bridge_ts, part, slices, group0_named, stats, out)
                slices = {}
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
                    self._reject_rest(stats, rest)
                    break
                budget -= 1
                bucket = slices[key] = []
            bucket.append(event)  # type: ignore[arg-type]
        if slices:
            self._flush(ident, seq, ts, bridge_ts, part, slices, group0_named, stats, out)
        return out

    @staticmethod
    def _reject_rest(stats: NormalizeStats, rest: Iterator[Event]) -> None:
        """The event just taken from `rest` and all after it: past the message budget."""
        stats.reject(TOO_MANY_MESSAGES, length_hint(rest) + 1, f"over {MAX_MESSAGES_PER_BATCH} messages")

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
        group0_named: bool,
        stats: NormalizeStats,
        out: list[GroupMessage | WorkerRecord],
    ) -> None:
        kinds = self.kinds
        if kinds.generation != self._generation:
            self._renew_decisions()
        # Every slice's kind is learned before any is resolved: group 0 without
        # one is legacy only if no group of the publisher ever named one.
        explicit = self._named_kinds(slices)
        if kinds.generation != self._generation:
            self._renew_decisions()
        decided, met = self._decided, self._met
        for group, events in slices.items():
            named = explicit.get(group)
            # Group 0 with no kind is the legacy full attention: events with no
            # group at all (before vLLM 0.20), or a publisher that names groups
            # but never kinds (0.20-0.21).
            legacy = group == 0 and named is None and (not group0_named or kinds.kindless_publisher)
            decision = decided.get((group, named, legacy))
            if decision is None:
                decision = self._decide(group, named, legacy)
            kind, source, family = decision
            whole = events
            if family == STATE:
                events = self._reduce_state(events, stats)
            elif family == WINDOW:
                events = self._handle_placeholders(events, stats)
            if source == "unknown":
                stats.transformed["unknown_kind"] += len(events)
            if not events:
                if group in met:
                    continue
                events = [_shape_store(whole, family, stats)]
            met.add(group)
            # Positional (v, worker, dp_rank, epoch, seq, ts, group, kind,
            # family, kind_source, events, topic, part, bridge_ts): keywords
            # cost a third more, once per slice.
            out.append(
                GroupMessage(
                    SCHEMA_VERSION, ident.worker, ident.dp_rank, ident.epoch, seq, ts, group, kind,
                    family, source, events, ident.topic, part, bridge_ts,
                )
            )

    def _named_kinds(self, slices: dict[int, list[GroupEvent]]) -> dict[int, str]:
        """Per group, the kind its slice's first store naming one names,
        cleaned and learned. A store before it that names none is told to the
        book (a 0.20-0.21 publisher names none at all). Mostly the slice's
        first event names it: this looks at one event per slice."""
        explicit: dict[int, str] = {}
        removed = BlockRemoved
        kinds, decided = self.kinds, self._decided
        kindless = False
        for group, events in slices.items():
            for event in events:
                if event.__class__ is removed:
                    continue
                raw = event.kv_cache_spec_kind  # type: ignore[union-attr]
                if raw is None:
                    kindless = True
                    continue
                kind = self._clean.get(raw)
                if kind is None:
                    kind = clean_kind(raw)
                explicit[group] = kind
                # decided since the book last moved: learned already
                if (group, kind, False) not in decided:
                    kinds.learn(group, kind)
                break
        if kindless:
            kinds.saw_kindless_store()
        return explicit

    def _renew_decisions(self) -> None:
        """The book moved: what it answered before may no longer hold."""
        self._decided.clear()
        self._generation = self.kinds.generation

    def _decide(self, group: int, named: str | None, legacy: bool) -> Decision:
        kind, source = self.kinds.resolve(group, legacy)
        if source == "learned" and named == kind:
            source = "event"
        decision = (kind, source, family_of(kind))
        if len(self._decided) < MAX_DECISIONS:
            self._decided[(group, named, legacy)] = decision
        return decision

    @staticmethod
    def _reduce_state(events: list[GroupEvent], stats: NormalizeStats) -> list[GroupEvent]:
        """A recurrent checkpoint is valid only at its hash (docs/contract.md, `state`).
        In the GPU tier vLLM lists only blocks that hold state, so every hash is
        a checkpoint. An offload tier holds one state per chunk: a multi-hash
        store there (an older or unpatched publisher) becomes its last hash,
        with the hash before it as parent. A store with no hash names no
        position. Token ids never align with the hashes: they go.

        The stores are this batch's own: changed in place, like placeholders;
        the list is rebuilt only when a store goes."""
        removed, raw = BlockRemoved, msgspec.Raw
        no_hash = 0
        for event in events:
            if event.__class__ is removed:
                continue
            hashes = event.block_hashes
            if not hashes:
                no_hash += 1
                continue
            if len(hashes) > 1:
                checkpoints = state_checkpoints(event.medium, hashes)
                if len(checkpoints) < len(hashes):
                    event.block_hashes = checkpoints
                    event.parent_block_hash = hashes[-len(checkpoints) - 1]  # type: ignore[union-attr]
                    stats.transformed["state_reduced"] += 1
            # vLLM sends a state store's tokens: a relayed store's are replaced
            # unlooked, as cheap as looking whether it has any
            if event.token_ids.__class__ is raw:  # type: ignore[union-attr]
                event.token_ids = EMPTY_RAW_ARRAY  # type: ignore[union-attr]
                if event.lookahead_token_ids is not NIL_RAW:  # type: ignore[union-attr]
                    event.lookahead_token_ids = NIL_RAW  # type: ignore[union-attr]  # RelayBlockStored's default
            else:
                if event.token_ids:  # type: ignore[union-attr]
                    event.token_ids = []  # type: ignore[union-attr]
                if event.lookahead_token_ids is not None:  # type: ignore[union-attr]
                    event.lookahead_token_ids = None  # type: ignore[union-attr]
        if no_hash:
            stats.dropped["state_no_hash"] += no_hash
            return [e for e in events if e.__class__ is removed or e.block_hashes]
        return events

    def _handle_placeholders(self, events: list[GroupEvent], stats: NormalizeStats) -> list[GroupEvent]:
        """Window placeholders (block_size=0) name no position: drop, or flag.
        The flag is the bridge's word, never the publisher's: a store that
        sets it and is no placeholder loses it."""
        removed, keep = BlockRemoved, self._keep_placeholders
        placeholders = 0
        for event in events:
            if event.__class__ is removed:
                continue
            if event.block_size == 0:  # type: ignore[union-attr]
                placeholders += 1
                if keep:
                    event.placeholder = True  # type: ignore[union-attr]
            elif event.placeholder:  # type: ignore[union-attr]
                event.placeholder = False  # type: ignore[union-attr]
        if not placeholders:
            return events
        if keep:
            stats.transformed["placeholder_flagged"] += placeholders
            return events
        stats.dropped["window_placeholder"] += placeholders
        return [e for e in events if e.__class__ is removed or e.block_size]  # type: ignore[union-attr]


def _shape_store(dropped: list[GroupEvent], family: str, stats: NormalizeStats) -> GroupEvent:
    """A group's first slice, every store of which named no position (hash-less
    state stores, window placeholders): its first store goes on as the group's
    shape store, naming nothing (no hash, parent, token ids, lookahead tokens or
    extra keys) but keeping vLLM's group_idx, kind, block_size, window and
    medium. Counted as a shape, not as dropped."""
    event = next(e for e in dropped if e.__class__ is not BlockRemoved)
    stats.dropped[_DROP_REASON[family]] -= 1
    stats.transformed["group_shape"] += 1
    relayed = event.__class__ is RelayBlockStored
    event.block_hashes = []
    event.parent_block_hash = None  # type: ignore[union-attr]
    event.token_ids = EMPTY_RAW_ARRAY if relayed else []  # type: ignore[union-attr]
    if relayed:
        event.lookahead_token_ids = NIL_RAW  # type: ignore[union-attr]
        event.extra_keys = NIL_RAW  # type: ignore[union-attr]
    else:
        event.lookahead_token_ids = None  # type: ignore[union-attr]
        event.extra_keys = None  # type: ignore[union-attr]
    event.placeholder = False  # type: ignore[union-attr]
    return event
