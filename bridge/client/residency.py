"""The residency index: which block hashes each worker holds, per group and medium.

Semantics (docs/consumers.md has the long form):

- Keyed by (worker, dp_rank) → group → medium → hash → count. vLLM announces
  the same hash again when a second physical block gets it, and removes each
  copy separately, so a store adds one and a removal takes one away; a hash is
  resident while its count is above zero. A removal of a hash the index does not
  hold is ignored and counted (`unknown_removals`): the store may predate the
  subscription.
- Groups are independent: a removal in the state group never touches the
  attention group's counts, and the reverse.
- `gap` record or local `Interruption`: removals may have been lost, so nothing
  the view holds can be trusted. Every entry moves to a *suspect* layer; stores
  after it land in the trusted layer again. Queries use trusted entries only,
  unless asked to include suspect ones. A removal takes from the trusted layer
  first, then the suspect one (the cautious choice when the copy is unknown).
- `cleared`: the worker's caches are empty: all entries go (both layers), the
  group structure stays.
- `restart`, `start` that is not `resumed`, or a message of a newer epoch
  without a record: a new vLLM process or an unknown past: everything for that
  worker and rank goes, groups included. `start` with reason `resumed` keeps
  the view (the bridge continued the same stream).
- `stop`: the bridge stopped watching: the view is kept but skipped by queries
  until traffic or a `start` comes back.
- Records and messages of an older epoch than the view's are ignored (counted).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from bridge.client.hashes import lookup_keys
from bridge.client.subscribe import BusMessage, Interruption
from bridge.contract import GroupMessage, WorkerRecord
from bridge.decode.wire import BlockHash, BlockStored
from bridge.normalize.kinds import OTHER, STATE, WINDOW, family_of

DEFAULT_MEDIUM = "GPU"  # vLLM before media existed reported only its GPU block pool
MAX_LOST_RANGES = 16

Table = dict[BlockHash, int]


class WorkerKey(NamedTuple):
    worker: str
    dp_rank: int


def _take(table: Table | None, key: BlockHash) -> bool:
    """One copy of `key` out of `table`; False when it holds none."""
    if not table:
        return False
    count = table.get(key, 0)
    if count <= 0:
        return False
    if count == 1:
        del table[key]
    else:
        table[key] = count - 1
    return True


class GroupResidency:
    """One kv_cache_group of one worker and rank."""

    __slots__ = ("group", "kind", "family", "block_size", "window", "trusted", "suspect", "placeholders",
                 "stored", "removed", "unknown_removals")

    def __init__(self, group: int, kind: str, family: str) -> None:
        self.group = group
        self.kind = kind
        self.family = family
        self.block_size = 0  # tokens per block, learned from stores; 0 = unknown
        self.window: int | None = None  # sliding window in tokens, from kv_cache_spec_sliding_window
        self.trusted: dict[str, Table] = {}
        self.suspect: dict[str, Table] = {}
        # Window placeholders name no position; they are held apart so their
        # removals balance without ever counting as residency.
        self.placeholders: dict[str, Table] = {}
        self.stored = 0
        self.removed = 0
        self.unknown_removals = 0

    def learn(self, kind: str, family: str) -> None:
        self.kind = kind
        self.family = family

    def store(self, medium: str, hashes: Iterable[BlockHash], placeholder: bool) -> None:
        table = (self.placeholders if placeholder else self.trusted).setdefault(medium, {})
        for h in hashes:
            table[h] = table.get(h, 0) + 1
            self.stored += 1

    def remove(self, medium: str, hashes: Iterable[BlockHash]) -> None:
        trusted = self.trusted.get(medium)
        suspect = self.suspect.get(medium)
        placeholders = self.placeholders.get(medium)
        for h in hashes:
            if _take(trusted, h) or _take(suspect, h) or _take(placeholders, h):
                self.removed += 1
            else:
                self.unknown_removals += 1

    def demote(self) -> None:
        """A gap: what is held may have been removed unseen."""
        for medium, table in self.trusted.items():
            suspect = self.suspect.setdefault(medium, {})
            for h, n in table.items():
                suspect[h] = suspect.get(h, 0) + n
        self.trusted = {}

    def clear(self) -> None:
        self.trusted = {}
        self.suspect = {}
        self.placeholders = {}

    def media(self) -> set[str]:
        return {m for layer in (self.trusted, self.suspect) for m, t in layer.items() if t}

    def resident(self, medium: str) -> int:
        """Distinct trusted hashes in `medium`."""
        return len(self.trusted.get(medium, ()))

    def suspect_count(self, medium: str | None = None) -> int:
        if medium is not None:
            return len(self.suspect.get(medium, ()))
        return sum(len(t) for t in self.suspect.values())

    def count(self, medium: str, h: BlockHash, *, suspect: bool = False) -> int:
        """Copies of `h` held (trusted layer, or the suspect layer)."""
        return (self.suspect if suspect else self.trusted).get(medium, {}).get(h, 0)

    def tables(self, media: Iterable[str] | None, include_suspect: bool) -> list[Table]:
        layers = (self.trusted, self.suspect) if include_suspect else (self.trusted,)
        out: list[Table] = []
        for layer in layers:
            for medium, table in layer.items():
                if table and (media is None or medium in media):
                    out.append(table)
        return out


class WorkerView:
    """Everything the index knows about one (worker, dp_rank)."""

    __slots__ = ("key", "epoch", "groups", "topic", "last_seq", "last_ts", "last_received", "lag", "watching",
                 "gaps", "restarts", "clears", "interruptions", "lost", "old_epoch_ignored", "messages")

    def __init__(self, key: WorkerKey, epoch: int) -> None:
        self.key = key
        self.epoch = epoch  # 0: not known yet; the first one seen is adopted as is
        self.groups: dict[int, GroupResidency] = {}
        self.topic = ""
        self.last_seq: int | None = None
        self.last_ts = 0.0  # vLLM's ts of the last batch seen
        self.last_received = 0.0  # this process's clock at that moment
        self.lag: float | None = None  # received − vLLM ts, seconds
        self.watching = True
        self.gaps = 0
        self.restarts = 0
        self.clears = 0
        self.interruptions = 0
        self.lost: list[tuple[int, int]] = []
        self.old_epoch_ignored = 0
        self.messages = 0

    @property
    def stale(self) -> bool:
        """Some entries are suspect: a gap or interruption since the last reset."""
        return any(g.suspect_count() for g in self.groups.values())

    def reset(self, epoch: int) -> None:
        self.epoch = epoch
        self.groups = {}
        self.last_seq = None

    def group(self, group: int, kind: str, family: str) -> GroupResidency:
        found = self.groups.get(group)
        if found is None:
            found = self.groups[group] = GroupResidency(group, kind, family)
        return found


class ResidencyIndex:
    """Feed it bus items in order; ask it which worker holds the longest
    hybrid-valid prefix of a request (`longest_prefix`)."""

    def __init__(self) -> None:
        self.views: dict[WorkerKey, WorkerView] = {}
        self.interruptions = 0

    # -- reading ---------------------------------------------------------

    def view(self, worker: str, dp_rank: int = 0) -> WorkerView | None:
        return self.views.get(WorkerKey(worker, dp_rank))

    def __iter__(self) -> Iterator[WorkerView]:
        return iter(list(self.views.values()))

    def forget(self, worker: str) -> None:
        """Drop every rank of a worker (e.g. the registry says it is gone for good)."""
        for key in [k for k in self.views if k.worker == worker]:
            del self.views[key]

    # -- feeding ---------------------------------------------------------

    def apply(self, item: BusMessage | Interruption | GroupMessage | WorkerRecord, received: float | None = None) -> None:
        if type(item) is BusMessage:
            received, body = item.received, item.body
        elif type(item) is Interruption:
            self.interrupt()
            return
        else:
            body = item  # type: ignore[assignment]
        if type(body) is GroupMessage:
            self.apply_group(body, received)
        else:
            self.apply_record(body)  # type: ignore[arg-type]

    def interrupt(self) -> None:
        """Messages may have been lost for every worker (this consumer's own gap)."""
        self.interruptions += 1
        for view in self.views.values():
            view.interruptions += 1
            for g in view.groups.values():
                g.demote()

    def _current(self, worker: str, dp_rank: int, epoch: int) -> WorkerView | None:
        """The view for a message of `epoch`, reset when the epoch is newer
        (a new vLLM process whose records we did not see); None when older."""
        key = WorkerKey(worker, dp_rank)
        view = self.views.get(key)
        if view is None:
            view = self.views[key] = WorkerView(key, epoch)
        elif view.epoch == 0:
            view.epoch = epoch
        elif epoch < view.epoch:
            view.old_epoch_ignored += 1
            return None
        elif epoch > view.epoch:
            view.reset(epoch)
        return view

    def apply_group(self, msg: GroupMessage, received: float | None = None) -> None:
        view = self._current(msg.worker, msg.dp_rank, msg.epoch)
        if view is None:
            return
        view.watching = True
        view.messages += 1
        view.topic = msg.topic
        g = view.group(msg.group, msg.kind, msg.family)
        if msg.kind_source != "unknown" and (g.kind != msg.kind or g.family != msg.family):
            g.learn(msg.kind, msg.family)
        family = g.family
        for event in msg.events:
            medium = event.medium or DEFAULT_MEDIUM
            if type(event) is BlockStored:
                if event.block_size > 0 and not event.placeholder:
                    g.block_size = event.block_size
                if event.kv_cache_spec_sliding_window:
                    g.window = event.kv_cache_spec_sliding_window
                hashes = event.block_hashes
                if family == STATE and len(hashes) > 1:
                    # A checkpoint is valid at one hash only (the contract reduces
                    # these already; an older bridge may not have).
                    hashes = hashes[-1:]
                placeholder = family == WINDOW and (event.placeholder or event.block_size == 0)
                g.store(medium, hashes, placeholder)
            else:
                g.remove(medium, event.block_hashes)
        if view.last_seq is None or msg.seq >= view.last_seq:
            view.last_seq = msg.seq
        view.last_ts = msg.ts
        now = time.time() if received is None else received
        view.last_received = now
        view.lag = max(0.0, now - msg.ts)

    def apply_record(self, rec: WorkerRecord) -> None:
        key = WorkerKey(rec.worker, rec.dp_rank)
        if rec.type == "restart":
            view = self.views.get(key)
            if view is not None and view.epoch and rec.epoch < view.epoch:
                view.old_epoch_ignored += 1
                return
            view = view or self.views.setdefault(key, WorkerView(key, rec.epoch))
            view.reset(rec.epoch)
            view.restarts += 1
            view.watching = True
            return
        if rec.type == "start":
            view = self.views.get(key)
            if view is not None and view.epoch and rec.epoch < view.epoch:
                view.old_epoch_ignored += 1
                return
            if view is None:
                view = self.views[key] = WorkerView(key, rec.epoch)
            elif rec.reason == "resumed":
                view.epoch = rec.epoch
            else:
                # A fresh bridge saw nothing of the past: what we hold may be
                # long gone, and it will not tell us.
                view.reset(rec.epoch)
            view.watching = True
            view.topic = rec.topic
            return
        view = self._current(rec.worker, rec.dp_rank, rec.epoch)
        if view is None:
            return
        if rec.type == "gap":
            view.gaps += 1
            if rec.gap_from is not None and rec.gap_to is not None:
                view.lost.append((rec.gap_from, rec.gap_to))
                del view.lost[:-MAX_LOST_RANGES]
            for g in view.groups.values():
                g.demote()
        elif rec.type == "cleared":
            view.clears += 1
            for g in view.groups.values():
                g.clear()
        elif rec.type == "stop":
            view.watching = False

    def declare(self, worker: str, dp_rank: int, group: int, kind: str, block_size: int = 0,
                window: int | None = None) -> None:
        """Make a group known before it has announced anything (from the worker
        registry), so a state group with no checkpoint yet blocks prefixes
        instead of going unnoticed. Never overrides what messages taught."""
        key = WorkerKey(worker, dp_rank)
        view = self.views.get(key)
        if view is None:
            view = self.views[key] = WorkerView(key, 0)
        g = view.groups.get(group)
        if g is None:
            g = view.groups[group] = GroupResidency(group, kind, family_of(kind))
        elif g.family == OTHER and family_of(kind) != OTHER:
            g.learn(kind, family_of(kind))
        if not g.block_size and block_size > 0:
            g.block_size = block_size
        if g.window is None and window:
            g.window = window
