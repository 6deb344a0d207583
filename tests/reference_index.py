"""Today's residency index before the fleet structure (kept as it was): one
dict per worker rank, group, medium and layer, and a query that walks every
worker's tables for every block (workers x chain x groups).

It stays for two uses: the second oracle of the tests (tests/client/
test_index_fleet.py applies the same streams to it and to `ResidencyIndex`
and wants every answer equal), and the baseline of `python -m bench.index`.
It is the simplest correct statement of the semantics in docs/consumers.md,
so it lives in the package beside the real one rather than in tests/: the
bench imports it too. The prefix rule is not copied: it is
`bridge.residency.prefix` itself, so a rule fixed there holds for both and the
differential test shows whether the fleet structure follows.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import NamedTuple

from bridge.client.subscribe import BusMessage, Interruption
from bridge.contract import GPU_MEDIUM, GroupMessage, WorkerRecord, state_checkpoints
from bridge.contract.events import BlockHash, BlockStored
from bridge.contract.kinds import ATTENTION, OTHER, STATE, WINDOW, family_of
from bridge.residency.prefix import PrefixMatch, group_limit, match_view, match_views
from bridge.residency.slots import WorkerKey

Table = dict[BlockHash, int]


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


class ReferenceGroup:
    """One kv_cache_group of one worker and rank."""

    __slots__ = ("group", "kind", "family", "block_size", "window", "trusted", "suspect", "placeholders",
                 "stored", "removed", "unknown_removals", "last_position")

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
        # (seq, part, chunk) of the last message applied: within one epoch a
        # group's messages come in that order, so one at or below it is a copy.
        self.last_position: tuple[int, int, int] | None = None

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


class ReferenceView:
    """Everything the index knows about one (worker, dp_rank)."""

    __slots__ = ("key", "epoch", "groups", "topic", "last_seq", "last_ts", "last_received", "lag", "watching",
                 "gaps", "restarts", "clears", "interruptions", "lost", "old_epoch_ignored", "messages",
                 "duplicates_ignored", "partial")

    def __init__(self, key: WorkerKey, epoch: int) -> None:
        self.key = key
        self.epoch = epoch  # 0: not known yet; the first one seen is adopted as is
        self.groups: dict[int, ReferenceGroup] = {}
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
        self.duplicates_ignored = 0
        self.messages = 0
        # The view may lack part of its history (a newer epoch met without its record).
        self.partial = False

    @property
    def stale(self) -> bool:
        """Some entries are suspect (a gap or interruption since the last
        reset), or the view may lack part of its history."""
        return self.partial or any(g.suspect_count() for g in self.groups.values())

    def reset(self, epoch: int) -> None:
        self.epoch = epoch
        self.groups = {}
        self.last_seq = None
        self.partial = False

    def group(self, group: int, kind: str, family: str) -> ReferenceGroup:
        found = self.groups.get(group)
        if found is None:
            found = self.groups[group] = ReferenceGroup(group, kind, family)
        return found


DEFAULT_MEDIUM = GPU_MEDIUM  # vLLM before media existed reported only its GPU block pool
MAX_LOST_RANGES = 16


class _Declared(NamedTuple):
    kind: str
    block_size: int
    window: int | None


class _Reannounced:
    """Parent-less GPU stores of one batch position of one worker rank (report mode "full")."""

    __slots__ = ("at", "added", "chains", "tokenless")

    def __init__(self, at: tuple[int, int, int]) -> None:
        self.at = at  # (epoch, seq, part)
        self.added: Counter[tuple[int, BlockHash]] = Counter()  # GPU copies stored at this position
        self.chains: set[tuple[BlockHash, ...]] = set()  # announced again, not stored
        self.tokenless: list[tuple[ReferenceGroup, tuple[BlockHash, ...], list[BlockHash]]] = []  # may be taken back


class ReferenceIndex:
    """Feed it bus items in order; ask it which worker holds the longest
    hybrid-valid prefix of a request (`longest_prefix`)."""

    def __init__(self) -> None:
        self.views: dict[WorkerKey, ReferenceView] = {}
        self.interruptions = 0
        # Group structure from the worker registry: it outlives resets, so a
        # restarted worker's state group is known before it announces anything.
        self._declared: dict[WorkerKey, dict[int, _Declared]] = {}
        self._reannounced: dict[WorkerKey, _Reannounced] = {}
        self.reannounced_ignored = 0  # parent-less stores taken for report mode "full" announcements

    # -- reading ---------------------------------------------------------

    def view(self, worker: str, dp_rank: int = 0) -> ReferenceView | None:
        return self.views.get(WorkerKey(worker, dp_rank))

    def __iter__(self) -> Iterator[ReferenceView]:
        return iter(list(self.views.values()))

    def longest_prefix(
        self,
        chain: Sequence[BlockHash],
        *,
        media: Collection[str] | None = None,
        include_suspect: bool = False,
        include_unwatched: bool = False,
        skip_workers: Collection[str] = (),
    ) -> list[PrefixMatch]:
        """Per worker and rank, the deepest hybrid-valid prefix of `chain` (the
        request's block hashes in order, bytes or ints, as vLLM computes them),
        best first. `media` limits which tiers count (None: any); suspect entries
        count only with `include_suspect`; views whose bridge stopped, and
        `skip_workers` (e.g. dead in the registry), are left out."""
        views = [
            v for v in self.views.values()
            if (include_unwatched or v.watching) and v.key.worker not in skip_workers
        ]
        return match_views(views, chain, media, include_suspect)  # type: ignore[arg-type]  # the rule reads views by duck type

    def match(self, worker: str, dp_rank: int, chain: Sequence[BlockHash], *,
              media: Collection[str] | None = None, include_suspect: bool = False) -> PrefixMatch | None:
        """One worker's answer, whatever its state; None when unknown."""
        view = self.view(worker, dp_rank)
        return None if view is None else match_view(view, chain, media, include_suspect)  # type: ignore[arg-type]

    def forget(self, worker: str) -> None:
        """Drop every rank of a worker (e.g. the registry says it is gone for good)."""
        for key in [k for k in self.views if k.worker == worker]:
            del self.views[key]
        for key in [k for k in self._declared if k.worker == worker]:
            del self._declared[key]

    # -- feeding ---------------------------------------------------------

    def apply(
        self, item: BusMessage | Interruption | GroupMessage | WorkerRecord, received: float | None = None
    ) -> None:
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

    def _current(self, worker: str, dp_rank: int, epoch: int) -> ReferenceView | None:
        """The view for a message of `epoch`, reset when the epoch is newer
        (a new vLLM process whose records we did not see); None when older."""
        key = WorkerKey(worker, dp_rank)
        view = self.views.get(key)
        if view is None:
            view = self._new_view(key, epoch)
        elif view.epoch == 0:
            view.epoch = epoch
        elif epoch < view.epoch:
            view.old_epoch_ignored += 1
            return None
        elif epoch > view.epoch:
            self._reset(view, epoch)
            view.partial = True  # what the new process said before this is unknown
        return view

    def _new_view(self, key: WorkerKey, epoch: int) -> ReferenceView:
        view = self.views[key] = ReferenceView(key, epoch)
        for group, decl in self._declared.get(key, {}).items():
            self._seed(view, group, decl)
        return view

    def _reset(self, view: ReferenceView, epoch: int) -> None:
        view.reset(epoch)
        for group, decl in self._declared.get(view.key, {}).items():
            self._seed(view, group, decl)

    @staticmethod
    def _seed(view: ReferenceView, group: int, decl: _Declared) -> None:
        g = view.groups.get(group)
        if g is None:
            g = view.groups[group] = ReferenceGroup(group, decl.kind, family_of(decl.kind))
        elif g.family == OTHER and family_of(decl.kind) != OTHER:
            g.learn(decl.kind, family_of(decl.kind))
        if not g.block_size and decl.block_size > 0:
            g.block_size = decl.block_size
        if g.window is None and decl.window:
            g.window = decl.window

    def apply_group(self, msg: GroupMessage, received: float | None = None) -> None:
        view = self._current(msg.worker, msg.dp_rank, msg.epoch)
        if view is None:
            return
        g = view.group(msg.group, msg.kind, msg.family)
        position = (msg.seq, msg.part, msg.chunk)
        if g.last_position is not None and position <= g.last_position:
            # A JetStream publish sent again (its ack was late or lost with a
            # connection): the stream kept one copy, a core subscription sees
            # both, and a store applied twice could outlive its removal.
            view.duplicates_ignored += 1
            return
        g.last_position = position
        view.watching = True
        view.messages += 1
        view.topic = msg.topic
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
                if family == STATE:
                    # The contract's rule; an older bridge may not have applied it.
                    hashes = state_checkpoints(event.medium, hashes)
                placeholder = family == WINDOW and (event.placeholder or event.block_size == 0)
                if event.parent_block_hash is None and medium == GPU_MEDIUM and hashes and not placeholder \
                        and self._announced_again(view, g, msg, event, hashes):
                    continue
                g.store(medium, hashes, placeholder)
            else:
                g.remove(medium, event.block_hashes)
        if view.last_seq is None or msg.seq >= view.last_seq:
            view.last_seq = msg.seq
        view.last_ts = msg.ts
        now = time.time() if received is None else received
        view.last_received = now
        view.lag = max(0.0, now - msg.ts)

    def _announced_again(self, view: ReferenceView, g: ReferenceGroup, msg: GroupMessage, event: BlockStored,
                         stored: list[BlockHash]) -> bool:
        """Whether a parent-less GPU store is vLLM announcing a prefix hit again
        (report mode "full") rather than storing blocks; when it is not, it is
        stored and noted. A store that carries its tokens (attention and window
        groups) is one when, with what this batch stored left out, the worker
        could resume from its whole chain: vLLM stores parent-less blocks only
        for a request that reused nothing. A tokenless store (a state group: the
        bridge strips its tokens) is one when a store of the same chain at the
        same batch position was; if it came first, its copies are taken back."""
        at = (msg.epoch, msg.seq, msg.part)
        memo = self._reannounced.get(view.key)
        if memo is None or memo.at != at:
            memo = self._reannounced[view.key] = _Reannounced(at)
        chain = tuple(event.block_hashes)
        if chain in memo.chains:
            self.reannounced_ignored += 1
            return True
        if event.token_ids and event.block_size > 0 and len(event.token_ids) >= len(chain) * event.block_size \
                and self._resumable_before(view, memo, chain):
            memo.chains.add(chain)
            self.reannounced_ignored += 1
            keep = []
            for other, hashes, copies in memo.tokenless:
                if hashes != chain:
                    keep.append((other, hashes, copies))
                    continue
                other.remove(GPU_MEDIUM, copies)  # the copies that store added: no removal
                other.removed -= len(copies)
                other.stored -= len(copies)
                for h in copies:
                    memo.added[(other.group, h)] -= 1
                self.reannounced_ignored += 1
            memo.tokenless = keep
            return True
        for h in stored:
            memo.added[(g.group, h)] += 1
        if not event.token_ids:
            memo.tokenless.append((g, chain, list(stored)))
        return False

    @staticmethod
    def _resumable_before(view: ReferenceView, memo: _Reannounced, chain: tuple[BlockHash, ...]) -> bool:
        """The hybrid prefix rule at p = len(chain) on the GPU tier (trusted and
        suspect copies), without the copies stored at this batch position."""
        k = len(chain)
        constrained = False
        for group, res in view.groups.items():
            if res.family not in (ATTENTION, WINDOW, STATE):
                continue
            constrained = True
            held = [res.count(GPU_MEDIUM, h) + res.count(GPU_MEDIUM, h, suspect=True) - memo.added[(group, h)] > 0
                    for h in chain]
            allowed, _ = group_limit(res, held)
            if not allowed[k]:
                return False
        return constrained

    def apply_record(self, rec: WorkerRecord) -> None:
        key = WorkerKey(rec.worker, rec.dp_rank)
        if rec.type in ("restart", "start"):
            view = self.views.get(key)
            if view is not None and view.epoch and rec.epoch < view.epoch:
                view.old_epoch_ignored += 1
                return
            if view is None:
                view = self._new_view(key, rec.epoch)
            elif rec.type == "start" and rec.reason == "resumed":
                view.epoch = rec.epoch
            else:
                # A restart, or a fresh bridge that saw nothing of the past:
                # what we hold may be long gone, and nobody will tell us.
                self._reset(view, rec.epoch)
            if rec.type == "restart":
                view.restarts += 1
            else:
                view.topic = rec.topic
            view.watching = True
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
        decl = _Declared(kind, block_size, window)
        self._declared.setdefault(key, {})[group] = decl
        view = self.views.get(key)
        if view is None:
            view = self._new_view(key, 0)
        else:
            self._seed(view, group, decl)
