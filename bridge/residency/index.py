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
  worker and rank goes, groups included (those declared from the worker
  registry come back empty). `start` with reason `resumed` keeps the view (the
  bridge continued the same stream).
- `stop`: the bridge stopped watching: the view is kept but skipped by queries
  until traffic or a `start` comes back.
- Records and messages of an older epoch than the view's are ignored (counted).
- Report mode "full" (a request's `kv_cache_report_mode`): vLLM announces a
  prefix hit of k blocks again, in every group, as one parent-less BlockStored
  of the chain's first k hashes with their tokens, and adds no block (in window
  and state groups it even lists positions they do not hold). A parent-less GPU
  store that carries its tokens and whose whole chain the worker can already
  resume from is that announcement: it adds nothing, and the tokenless store of
  the same hashes in another group of the same batch (a state group, whose
  tokens the bridge strips) is taken back or skipped. Counted as copies, they
  outlived every removal.
- A group message at or before the last one applied to its group (by seq,
  part, chunk: what its Nats-Msg-Id names) is a copy, ignored and counted
  (`duplicates_ignored`): in JetStream mode the bridge publishes again what was
  not acked in time, and a core subscription sees both.

Storage and queries are the fleet structure's (`bridge.residency.fleet`: hash →
holders per group and medium), so a query costs the chain's length whatever
the number of workers; `fleet` is there for services that ask for many
workers at once (`prefix_hits`) or for aggregate counts. A reader that keeps
a few ranks and asks no fleet questions (the bridge's snapshot keeper) gives
the index per-rank tables instead (`ResidencyIndex(store=RankTables())`,
`bridge.residency.rank_tables`): the same rules, over a table per rank's
tier (applied by a native loop where the package's C module was built).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from typing import Literal, NamedTuple, Protocol, cast

import msgspec

from bridge.contract import GPU_MEDIUM, GroupMessage, WorkerRecord, state_checkpoints
from bridge.contract.events import BlockHash, BlockRemoved, BlockStored
from bridge.contract.kinds import OTHER, STATE, WINDOW, family_of
from bridge.contract.snapshot import SNAPSHOT_VERSION, GroupState, RankSnapshot, SnapshotMissing, TierState
from bridge.residency.cells import FAMILY_CODES
from bridge.residency.fleet import FleetResidency
from bridge.residency.lean import LeanStored, ResidencyMessage, token_count
from bridge.residency.prefix import RULED_FAMILIES, PrefixMatch, allowed_at, needed_before, window_blocks
from bridge.residency.rank_tables import RankTables
from bridge.residency.slots import WorkerKey
from bridge.residency.views import GroupResidency, SlotStore, WorkerView


class Interruption(msgspec.Struct, frozen=True):
    """Messages may be missing before the next item: the consumer's own loss
    (a core NATS disconnect, a slow-consumer drop), not one the bridge named."""

    reason: Literal["disconnect", "slow_consumer"]
    ts: float


class Envelope(Protocol):
    """A contract message as a subscription hands it over (bridge.client's
    BusMessage): the body and when it came off the socket."""

    @property
    def body(self) -> GroupMessage | WorkerRecord: ...

    @property
    def received(self) -> float: ...


DEFAULT_MEDIUM = GPU_MEDIUM  # vLLM before media existed reported only its GPU block pool
MAX_LOST_RANGES = 16


class _Declared(NamedTuple):
    kind: str
    block_size: int
    window: int | None


def _held_before(res: GroupResidency, group: int, chain: Sequence[BlockHash],
                 added: dict[tuple[int, BlockHash], int]) -> Callable[[int], bool]:
    """Whether the group holds chain[i] on the GPU tier, leaving out the copies
    stored at this batch position."""
    def held_at(i: int) -> bool:
        h = chain[i]
        return res.held(GPU_MEDIUM, h) - added.get((group, h), 0) > 0
    return held_at


# A group message's events: stores and removals only (clears split a batch).
_Events = Sequence["BlockStored | LeanStored | BlockRemoved"]


class _Reannounced:
    """Parent-less GPU stores of one batch position of one worker rank (report mode "full")."""

    __slots__ = ("at", "_added", "_unsorted", "noted", "chains", "tokenless")

    def __init__(self, at: tuple[int, int, int]) -> None:
        self.at = at  # (epoch, seq, part)
        # GPU copies stored at this position, per (group, hash): counted only
        # when a rule asks, since most positions never need them. A dict, not
        # a Counter: one of these is made per batch position, and a Counter's
        # constructor runs in Python.
        self._added: dict[tuple[int, BlockHash], int] = {}
        self._unsorted: list[tuple[int, list[BlockHash]]] = []
        self.noted: set[int] = set()  # groups with copies stored at this position
        self.chains: set[tuple[BlockHash, ...]] = set()  # announced again, not stored
        self.tokenless: list[tuple[GroupResidency, tuple[BlockHash, ...], list[BlockHash]]] = []  # may be taken back

    def note(self, group: int, stored: list[BlockHash]) -> None:
        self._unsorted.append((group, stored))
        self.noted.add(group)

    @property
    def added(self) -> dict[tuple[int, BlockHash], int]:
        if self._unsorted:
            added = self._added
            get = added.get
            for group, stored in self._unsorted:
                for h in stored:
                    key = (group, h)
                    added[key] = get(key, 0) + 1
            self._unsorted.clear()
        return self._added


class IndexStore(SlotStore, Protocol):
    """An index's store: the slots its views keep, and its queries."""

    def demote_all(self) -> None: ...

    def longest_prefix(self, chain: Sequence[BlockHash], *, media: Collection[str] | None = None,
                       include_suspect: bool = False, include_unwatched: bool = False,
                       skip_workers: Collection[str] = ()) -> list[PrefixMatch]: ...

    def match(self, slot: int, chain: Sequence[BlockHash], media: Collection[str] | None = None,
              include_suspect: bool = False) -> PrefixMatch: ...

    @property
    def entries(self) -> int: ...

    @property
    def hashes(self) -> int: ...


class ResidencyIndex:
    """Feed it bus items in order; ask it which worker holds the longest
    hybrid-valid prefix of a request (`longest_prefix`). `store`: where the
    copies live (default: the fleet structure)."""

    def __init__(self, store: IndexStore | None = None) -> None:
        self.store: IndexStore = store if store is not None else FleetResidency()
        self.views: dict[WorkerKey, WorkerView] = {}
        self.interruptions = 0
        # Group structure from the worker registry: it outlives resets, so a
        # restarted worker's state group is known before it announces anything.
        self._declared: dict[WorkerKey, dict[int, _Declared]] = {}
        self._reannounced: dict[WorkerKey, _Reannounced] = {}
        self.reannounced_ignored = 0  # parent-less stores taken for report mode "full" announcements
        # (slot, group) → (the store's shapes count, the other ruled groups), for the native loop
        self._others: dict[tuple[int, int], tuple[int, tuple[tuple[int, int, int], ...]]] = {}

    @property
    def fleet(self) -> FleetResidency:
        """The fleet structure, for fleet-wide questions (`prefix_hits`, counts)."""
        if not isinstance(self.store, FleetResidency):
            raise TypeError("this index keeps per-rank tables, not the fleet structure")
        return self.store

    # -- reading ---------------------------------------------------------

    def view(self, worker: str, dp_rank: int = 0) -> WorkerView | None:
        return self.views.get(WorkerKey(worker, dp_rank))

    def __iter__(self) -> Iterator[WorkerView]:
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
        return self.store.longest_prefix(chain, media=media, include_suspect=include_suspect,
                                         include_unwatched=include_unwatched, skip_workers=skip_workers)

    def match(self, worker: str, dp_rank: int, chain: Sequence[BlockHash], *,
              media: Collection[str] | None = None, include_suspect: bool = False) -> PrefixMatch | None:
        """One worker's answer, whatever its state; None when unknown."""
        view = self.view(worker, dp_rank)
        return None if view is None else self.store.match(view.slot, chain, media, include_suspect)

    def forget(self, worker: str) -> None:
        """Drop every rank of a worker (e.g. the registry says it is gone for good)."""
        for key in [k for k in self.views if k.worker == worker]:
            self.views.pop(key).release()
        for key in [k for k in self._declared if k.worker == worker]:
            del self._declared[key]

    # -- feeding ---------------------------------------------------------

    def apply(
        self,
        item: Envelope | Interruption | GroupMessage | WorkerRecord | RankSnapshot | SnapshotMissing,
        received: float | None = None,
    ) -> None:
        kind = type(item)
        if kind is GroupMessage:
            self.apply_group(item, received)  # type: ignore[arg-type]
        elif kind is WorkerRecord:
            self.apply_record(item)  # type: ignore[arg-type]
        elif kind is Interruption:
            self.interrupt()
        elif kind is RankSnapshot:
            self.restore(item)  # type: ignore[arg-type]
        elif kind is SnapshotMissing:
            self.missing(item.worker, item.dp_rank)  # type: ignore[union-attr]
        else:
            body = item.body  # type: ignore[union-attr]
            if type(body) is GroupMessage:
                self.apply_group(body, item.received)  # type: ignore[union-attr]
            else:
                self.apply_record(body)  # type: ignore[arg-type]

    def interrupt(self) -> None:
        """Messages may have been lost for every worker (this consumer's own gap)."""
        self.interruptions += 1
        for view in self.views.values():
            view.interruptions += 1
        self.store.demote_all()

    def lose(self, worker: str, dp_rank: int) -> None:
        """This reader skipped some of one rank's messages (it could not keep
        up): the view may lack stores and hold blocks since removed, so it is
        partial (every answer from it stale) until a record empties it. A rank
        not seen yet starts so. Its entries are left where they are: moving
        them all to the suspect layer costs a microsecond each, and a reader
        that could not keep up has no time for that."""
        key = WorkerKey(worker, dp_rank)
        view = self.views.get(key)
        if view is None:
            view = self._new_view(key, 0)
        view.interruptions += 1
        view.partial = True

    def _current(self, worker: str, dp_rank: int, epoch: int) -> WorkerView | None:
        """The view for a message of `epoch`, reset when the epoch is newer
        (a new vLLM process whose records we did not see); None when older."""
        # A WorkerKey is a tuple: a plain one finds the same entry, and costs
        # less to make than the named one, once per message.
        view = self.views.get((worker, dp_rank))  # type: ignore[call-overload]
        if view is None:
            view = self._new_view(WorkerKey(worker, dp_rank), epoch)
        elif view.epoch == 0:
            view.epoch = epoch
        elif epoch < view.epoch:
            view.old_epoch_ignored += 1
            return None
        elif epoch > view.epoch:
            # A new vLLM process whose restart record we never met (lost, or
            # rolled off the stream before we read it): what it announced
            # before this message is unknown, so the view is partial until a
            # record empties it.
            self._reset(view, epoch)
            view.partial = True
        return view

    def _new_view(self, key: WorkerKey, epoch: int) -> WorkerView:
        view = self.views[key] = WorkerView(key, epoch, self.store)
        for group, decl in self._declared.get(key, {}).items():
            self._seed(view, group, decl)
        return view

    def _reset(self, view: WorkerView, epoch: int) -> None:
        view.reset(epoch)
        for group, decl in self._declared.get(view.key, {}).items():
            self._seed(view, group, decl)

    @staticmethod
    def _seed(view: WorkerView, group: int, decl: _Declared) -> None:
        g = view.groups.get(group)
        if g is None:
            g = view.groups[group] = GroupResidency(group, decl.kind, family_of(decl.kind))
        elif g.family == OTHER and family_of(decl.kind) != OTHER:
            g.learn(decl.kind, family_of(decl.kind))
        if not g.block_size and decl.block_size > 0:
            g.block_size = decl.block_size
        if g.window is None and decl.window:
            g.window = decl.window

    def apply_group(self, msg: GroupMessage | ResidencyMessage, received: float | None = None) -> None:
        opened = self._open(msg)
        if opened is not None:
            view, g = opened
            self._apply_events(view, g, msg, cast(_Events, msg.events))
            self._close(view, msg, received)

    def apply_group_steps(self, msg: GroupMessage | ResidencyMessage, received: float | None = None,
                          every: int = 0) -> Generator[None, None, None]:
        """`apply_group` as steps: with `every`, a pause after every `every`
        events, so that a reader on an event loop can apply a long message
        in pieces. Nothing else may change the index until it is done."""
        opened = self._open(msg)
        if opened is None:
            return
        view, g = opened
        events = cast(_Events, msg.events)
        if every and len(events) > every:
            memo = None
            for start in range(0, len(events), every):
                if start:
                    yield
                memo = self._apply_events(view, g, msg, events[start:start + every], memo)
        else:
            self._apply_events(view, g, msg, events)
        self._close(view, msg, received)

    def _open(self, msg: GroupMessage | ResidencyMessage) -> tuple[WorkerView, GroupResidency] | None:
        """The view and group a message applies to; None when it is not to
        be applied (an older epoch, or a position already applied)."""
        view = self._current(msg.worker, msg.dp_rank, msg.epoch)
        if view is None:
            return None
        g = view.group(msg.group, msg.kind, msg.family)
        position = (msg.seq, msg.part, msg.chunk)
        if g.last_position is not None and position <= g.last_position:
            # A JetStream publish sent again (its ack was late or lost with a
            # connection): the stream kept one copy, a core subscription sees
            # both, and a store applied twice could outlive its removal.
            view.duplicates_ignored += 1
            return None
        g.last_position = position
        view.watching = True
        view.messages += 1
        view.topic = msg.topic
        if msg.kind_source != "unknown" and (g.kind != msg.kind or g.family != msg.family):
            g.learn(msg.kind, msg.family)
        return view, g

    def _apply_events(self, view: WorkerView, g: GroupResidency, msg: GroupMessage | ResidencyMessage,
                      events: _Events, memo: _Reannounced | None = None) -> _Reannounced | None:
        """Applies a run of the message's events; `memo`: the batch position's
        parent-less stores, once an earlier run looked them up (returned for the next).
        Over per-rank tables of native cells, a native loop applies them
        (`RankTables.run_events`) and leaves to this one each event it does
        not read; the same rules either way."""
        store = self.store
        if type(store) is RankTables and store.native_runs and type(events) is list:
            if memo is None:
                # kept for the rank only once used, as the Python loop makes
                # it at the first parent-less store
                memo = self._memo(view.key, msg, keep=False)
            # the rank's other groups the report-mode rule reads: (number, family, window blocks or -1)
            key = (g._slot, g.group)
            known = self._others.get(key)
            if known is not None and known[0] == store.shapes:
                others = known[1]
            else:
                others = tuple((n, FAMILY_CODES[res.family], _or_minus_one(window_blocks(res.window, res.block_size)))
                               for n, res in view.groups.items() if res is not g and res.family in RULED_FAMILIES)
                self._others[key] = (store.shapes, others)
            family = FAMILY_CODES.get(g.family, 0)
            i, n = 0, len(events)
            while i < n:
                i = store.run_events(self, g, family, events, i, memo, others)
                if i < n:
                    self._apply_events_py(view, g, msg, events[i:i + 1], memo)
                    i += 1
            if (memo.noted or memo.chains) and self._reannounced.get(view.key) is not memo:
                self._reannounced[view.key] = memo
            return memo
        return self._apply_events_py(view, g, msg, events, memo)

    def _apply_events_py(self, view: WorkerView, g: GroupResidency, msg: GroupMessage | ResidencyMessage,
                         events: _Events, memo: _Reannounced | None = None) -> _Reannounced | None:
        """`_apply_events` in Python: the rules' reference, and what runs
        over any other store."""
        family = g.family
        block_size = g.block_size
        for event in events:
            medium = event.medium or DEFAULT_MEDIUM
            # `isinstance` on a msgspec struct takes about six times as long as
            # a class identity test: the classes the decoders make go first.
            cls = event.__class__
            if cls is BlockRemoved or (cls is not LeanStored and cls is not BlockStored
                                       and isinstance(event, BlockRemoved)):
                g.remove(medium, event.block_hashes)
                continue
            store: BlockStored | LeanStored = event  # type: ignore[assignment]  # by the class test above
            if store.block_size > 0 and store.block_size != block_size and not store.placeholder:
                g.block_size = block_size = store.block_size
            if store.kv_cache_spec_sliding_window:
                g.window = store.kv_cache_spec_sliding_window
            hashes = store.block_hashes
            if family == STATE:
                # The contract's rule; an older bridge may not have applied it.
                hashes = state_checkpoints(store.medium, hashes)
            placeholder = family == WINDOW and (store.placeholder or store.block_size == 0)
            if store.parent_block_hash is None and medium == GPU_MEDIUM and hashes and not placeholder:
                if memo is None:
                    memo = self._memo(view.key, msg)
                if self._announced_again(view, g, memo, store, hashes):
                    continue
            g.store(medium, hashes, placeholder)
        return memo

    @staticmethod
    def _close(view: WorkerView, msg: GroupMessage | ResidencyMessage, received: float | None) -> None:
        if view.last_seq is None or msg.seq >= view.last_seq:
            view.last_seq = msg.seq
        view.last_ts = msg.ts
        now = time.time() if received is None else received
        view.last_received = now
        view.lag = max(0.0, now - msg.ts)

    def _memo(self, key: WorkerKey, msg: GroupMessage | ResidencyMessage, keep: bool = True) -> _Reannounced:
        """The parent-less stores of the rank's current batch position (all
        its groups' messages); a new one is kept for the rank unless `keep`
        is False (the caller keeps it once used)."""
        at = (msg.epoch, msg.seq, msg.part)
        memo = self._reannounced.get(key)
        if memo is None or memo.at != at:
            memo = _Reannounced(at)
            if keep:
                self._reannounced[key] = memo
        return memo

    def _announced_again(self, view: WorkerView, g: GroupResidency, memo: _Reannounced,
                         event: BlockStored | LeanStored, stored: list[BlockHash]) -> bool:
        """Whether a parent-less GPU store is vLLM announcing a prefix hit again
        (report mode "full") rather than storing blocks; when it is not, it is
        stored and noted. A store that carries its tokens (attention and window
        groups) is one when, with what this batch stored left out, the worker
        could resume from its whole chain: vLLM stores parent-less blocks only
        for a request that reused nothing. A tokenless store (a state group: the
        bridge strips its tokens) is one when a store of the same chain at the
        same batch position was; if it came first, its copies are taken back."""
        chain = event.block_hashes
        if memo.chains and tuple(chain) in memo.chains:
            self.reannounced_ignored += 1
            return True
        tokens = token_count(event)
        if tokens and event.block_size > 0 and tokens >= len(chain) * event.block_size \
                and self._resumable_before(view, memo, chain):
            key = tuple(chain)
            memo.chains.add(key)
            self.reannounced_ignored += 1
            keep = []
            for other, hashes, copies in memo.tokenless:
                if hashes != key:
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
        memo.note(g.group, stored)
        if not tokens:
            memo.tokenless.append((g, tuple(chain), list(stored)))
        return False

    @staticmethod
    def _resumable_before(view: WorkerView, memo: _Reannounced, chain: Sequence[BlockHash]) -> bool:
        """The hybrid prefix rule at p = len(chain) on the GPU tier (trusted and
        suspect copies), without the copies stored at this batch position."""
        k = len(chain)
        constrained = False
        last = chain[-1]
        for res in view.groups.values():
            family = res.family
            if family not in RULED_FAMILIES:
                continue
            # Every group that needs a block at all needs the one at k - 1: a
            # fresh request's store, the common case, fails here at one lookup.
            # (Copies stored at this position are counted in too: none held, none to leave out.)
            # The test is `needed_before(res, k) > 0` spelled out: this loop
            # runs for every parent-less store, and the call cost 5 to 10% of
            # the index's time per event.
            if (family != WINDOW or window_blocks(res.window, res.block_size) != 0) and \
                    res.held(GPU_MEDIUM, last) <= 0:
                return False
        noted = memo.noted
        for group, res in view.groups.items():
            if res.family not in RULED_FAMILIES:
                continue
            constrained = True
            if group in noted:
                # Copies this position stored are left out, block by block.
                if not allowed_at(res, _held_before(res, group, chain, memo.added), k):
                    return False
            elif not res.holds_all(GPU_MEDIUM, chain[k - needed_before(res, k):]):
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
            # A partial view stays so: its caches are empty now, but a group
            # it never heard of (an empty state group blocks every prefix)
            # is still missing from it.
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

    # -- snapshots (bridge.contract.snapshot) ------------------------------

    def snapshot(self, worker: str, dp_rank: int, *, through: str = "", stream_seq: int = 0,
                 now: float | None = None) -> RankSnapshot | None:
        """The rank's view as a snapshot after the message `through` (None
        when the index has no view of the rank)."""
        steps = self.snapshot_steps(worker, dp_rank, through=through, stream_seq=stream_seq, now=now)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return cast("RankSnapshot | None", done.value)

    def snapshot_steps(self, worker: str, dp_rank: int, *, through: str = "", stream_seq: int = 0,
                       now: float | None = None) -> Generator[None, None, RankSnapshot | None]:
        """`snapshot`, a piece at a time: yields every few hundred
        microseconds of reading (the store's `held_columns`) and returns the
        snapshot, so that a caller on an event loop can take a large view
        between its other work. Nothing may change the index until the
        generator is done."""
        view = self.views.get(WorkerKey(worker, dp_rank))
        if view is None:
            return None
        groups = []
        for number, g in sorted(view.groups.items()):
            tiers = []
            for medium in g.trusted:  # every medium the group has a cell in
                c = yield from g.held_columns(medium)
                tiers.append(TierState(medium, c.trusted, c.trusted_copies, c.suspect, c.suspect_copies,
                                       c.placeholders, c.placeholder_copies))
                yield
            groups.append(GroupState(number, g.kind, g.family, g.block_size, g.window, g.last_position, g.stored,
                                     g.removed, g.unknown_removals, tiers))
        return RankSnapshot(
            v=SNAPSHOT_VERSION, worker=worker, dp_rank=dp_rank, epoch=view.epoch,
            taken_at=time.time() if now is None else now, complete=not view.partial, through=through,
            stream_seq=stream_seq, topic=view.topic, last_seq=view.last_seq, last_ts=view.last_ts,
            watching=view.watching, messages=view.messages, gaps=view.gaps, restarts=view.restarts,
            clears=view.clears, duplicates_ignored=view.duplicates_ignored, old_epoch_ignored=view.old_epoch_ignored,
            lost=list(view.lost), groups=groups,
        )

    def restore(self, snap: RankSnapshot) -> WorkerView:
        """The rank's view replaced by the snapshot's: what a consumer that
        watched from the start holds after the snapshot's message."""
        key = WorkerKey(snap.worker, snap.dp_rank)
        view = self.views.get(key)
        if view is None:
            view = self._new_view(key, snap.epoch)
        else:
            self._reset(view, snap.epoch)
        view.topic = snap.topic
        view.last_seq, view.last_ts = snap.last_seq, snap.last_ts
        view.messages, view.gaps, view.restarts, view.clears = snap.messages, snap.gaps, snap.restarts, snap.clears
        view.duplicates_ignored, view.old_epoch_ignored = snap.duplicates_ignored, snap.old_epoch_ignored
        view.lost = [tuple(r) for r in snap.lost]  # type: ignore[misc]
        view.watching = snap.watching
        for gs in snap.groups:
            g = view.group(gs.group, gs.kind, gs.family)
            g.learn(gs.kind, gs.family)
            g.block_size, g.window = gs.block_size, gs.window
            g.last_position = tuple(gs.last_position) if gs.last_position is not None else None  # type: ignore[assignment]
            # Suspect copies are trusted ones demoted: stored first, demoted,
            # then the trusted copies on top (a hash may have both).
            suspect = [(t.medium, _copies(t.suspect, t.suspect_copies)) for t in gs.tiers if t.suspect]
            for medium, hashes in suspect:
                g.store(medium, hashes, False)
            if suspect:
                g.demote()
            for t in gs.tiers:
                g.store(t.medium, _copies(t.trusted, t.trusted_copies), False)
                if t.placeholders:
                    g.store(t.medium, _copies(t.placeholders, t.placeholder_copies), True)
            g.stored, g.removed, g.unknown_removals = gs.stored, gs.removed, gs.unknown_removals
        view.partial = not snap.complete
        return view

    def missing(self, worker: str, dp_rank: int) -> WorkerView:
        """No snapshot of the rank could be had: its view is what messages
        tell from now on, stale until a restart or a fresh start empties it."""
        key = WorkerKey(worker, dp_rank)
        view = self.views.get(key) or self._new_view(key, 0)
        view.partial = True
        return view


def _or_minus_one(n: int | None) -> int:
    return -1 if n is None else n


# vLLM adds a copy per physical block holding a hash: a handful. A count far
# beyond it in a snapshot is damage, not residency (and would be expanded).
_MAX_COPIES = 1 << 16


def _copies(hashes: list[BlockHash], copies: list[int]) -> list[BlockHash]:
    """Each hash as many times as it has copies (a store adds one per listing)."""
    if not copies:
        return hashes
    if len(copies) != len(hashes) or any(not 1 <= n <= _MAX_COPIES for n in copies):
        raise ValueError("snapshot copies do not match their hashes")
    return [h for h, n in zip(hashes, copies) for _ in range(n)]
