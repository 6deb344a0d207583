"""Residency of one worker and rank: per group, per medium, hash → copies.

The data lives in the index's store, one for the whole index: the fleet
structure (`bridge.residency.fleet`), or per-rank tables for a reader of a
few ranks (`bridge.residency.rank_tables`); these are its per-worker faces,
with the attributes and methods consumers read (docs/consumers.md). `trusted`, `suspect` and `placeholders`
are read-only mappings medium → {hash: copies}, computed on reading.

The rules for feeding it (records, epochs) live in `bridge.residency.index`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from bridge.contract import BlockHash
from bridge.residency.fleet import FleetResidency
from bridge.residency.held_columns import HeldColumns
from bridge.residency.prefix import GroupShape, Table
from bridge.residency.slots import WorkerKey


class SlotStore(Protocol):
    """Where views keep their copies, one slot per worker rank: what
    `FleetResidency` and `RankTables` both offer."""

    def add_slot(self, key: WorkerKey) -> int: ...

    def release(self, slot: int) -> None: ...

    def set_watching(self, slot: int, watching: bool) -> None: ...

    def stale(self, slot: int) -> bool: ...

    def set_partial(self, slot: int, partial: bool) -> None: ...

    def set_shape(self, slot: int, group: int, shape: GroupShape) -> None: ...

    def drop_shape(self, slot: int, group: int) -> None: ...

    def reshape(self) -> None: ...

    def store(self, slot: int, group: int, medium: str, hashes: list[BlockHash], placeholder: bool = False) -> None: ...

    def remove(self, slot: int, group: int, medium: str, hashes: list[BlockHash]) -> tuple[int, int]: ...

    def demote(self, slot: int, group: int) -> None: ...

    def clear(self, slot: int, group: int) -> None: ...

    def cell_media(self, slot: int, group: int) -> list[str]: ...

    def cell_counts(self, slot: int, group: int, medium: str) -> tuple[int, int, int]: ...

    def copies(self, slot: int, group: int, medium: str, h: BlockHash, layer: str) -> int: ...

    def held(self, slot: int, group: int, medium: str, h: BlockHash) -> int: ...

    def holds_all(self, slot: int, group: int, medium: str, hashes: Sequence[BlockHash]) -> bool: ...

    def layer_items(self, slot: int, group: int, medium: str, layer: str) -> Iterator[tuple[BlockHash, int]]: ...

    def held_columns(self, slot: int, group: int, medium: str) -> Generator[None, None, HeldColumns]: ...

    def first_trusted(self, slot: int, group: int, medium: str, n: int) -> list[BlockHash]: ...


class _Table(Mapping[BlockHash, int]):
    """One layer of one medium of one group: hash → copies (a live view)."""

    __slots__ = ("_g", "_medium", "_layer")

    def __init__(self, g: GroupResidency, medium: str, layer: str) -> None:
        self._g, self._medium, self._layer = g, medium, layer

    def __getitem__(self, h: BlockHash) -> int:
        g = self._g
        n = 0 if g._fleet is None else g._fleet.copies(g._slot, g.group, self._medium, h, self._layer)
        if n <= 0:
            raise KeyError(h)
        return n

    def __contains__(self, h: object) -> bool:
        g = self._g
        return g._fleet is not None and g._fleet.copies(g._slot, g.group, self._medium, h, self._layer) > 0  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[BlockHash]:
        g = self._g
        if g._fleet is not None:
            for h, _ in g._fleet.layer_items(g._slot, g.group, self._medium, self._layer):
                yield h

    def items(self) -> Any:
        return list(self.pairs())

    def pairs(self) -> Iterator[tuple[BlockHash, int]]:
        """(hash, copies), read lazily: a long layer can be read a piece at a time."""
        g = self._g
        return iter(()) if g._fleet is None else g._fleet.layer_items(g._slot, g.group, self._medium, self._layer)

    def __len__(self) -> int:
        g = self._g
        if g._fleet is None:
            return 0
        trusted, suspect, placeholders = g._fleet.cell_counts(g._slot, g.group, self._medium)
        if self._layer == "trusted":
            return trusted
        if self._layer == "suspect":
            return suspect
        return len(self.items())

    def __repr__(self) -> str:
        return repr(dict(self.items()))


class _Layer(Mapping[str, _Table]):
    """medium → table, for the media this group has used since its last clear."""

    __slots__ = ("_g", "_layer")

    def __init__(self, g: GroupResidency, layer: str) -> None:
        self._g, self._layer = g, layer

    def _media(self) -> list[str]:
        g = self._g
        return [] if g._fleet is None else g._fleet.cell_media(g._slot, g.group)

    def __getitem__(self, medium: str) -> _Table:
        if medium not in self._media():
            raise KeyError(medium)
        return _Table(self._g, medium, self._layer)

    def __iter__(self) -> Iterator[str]:
        return iter(self._media())

    def __len__(self) -> int:
        return len(self._media())

    def __repr__(self) -> str:
        return repr({m: dict(t.items()) for m, t in self.items()})


class GroupResidency:
    """One kv_cache_group of one worker and rank."""

    __slots__ = ("group", "kind", "_family", "_block_size", "_window", "stored", "removed", "unknown_removals",
                 "last_position", "_fleet", "_slot")

    def __init__(self, group: int, kind: str, family: str) -> None:
        self.group = group
        self.kind = kind
        self._family = family
        self._block_size = 0  # tokens per block, learned from stores; 0 = unknown
        self._window: int | None = None  # sliding window in tokens, from kv_cache_spec_sliding_window
        self.stored = 0
        self.removed = 0
        self.unknown_removals = 0
        # (seq, part, chunk) of the last message applied: within one epoch a
        # group's messages come in that order, so one at or below it is a copy.
        self.last_position: tuple[int, int, int] | None = None
        self._fleet: SlotStore | None = None  # set when a view takes it
        self._slot = -1

    # The rule reads these three; a change tells the fleet.
    @property
    def family(self) -> str:
        return self._family

    @family.setter
    def family(self, value: str) -> None:
        if value != self._family:
            self._family = value
            self._reshape()

    @property
    def block_size(self) -> int:
        return self._block_size

    @block_size.setter
    def block_size(self, value: int) -> None:
        if value != self._block_size:
            self._block_size = value
            self._reshape()

    @property
    def window(self) -> int | None:
        return self._window

    @window.setter
    def window(self, value: int | None) -> None:
        if value != self._window:
            self._window = value
            self._reshape()

    def _reshape(self) -> None:
        if self._fleet is not None:
            self._fleet.reshape()

    def _bound(self) -> SlotStore:
        """The fleet holding this group's data; a group no view took gets one of its own."""
        if self._fleet is None:
            fleet: SlotStore = FleetResidency()
            slot = fleet.add_slot(WorkerKey("", 0))
            self._fleet, self._slot = fleet, slot
            fleet.set_shape(slot, self.group, self)
        return self._fleet

    def _holds_anything(self) -> bool:
        f = self._fleet
        return f is not None and any(f.cell_counts(self._slot, self.group, m) != (0, 0, 0)
                                     for m in f.cell_media(self._slot, self.group))

    def learn(self, kind: str, family: str) -> None:
        self.kind = kind
        self.family = family

    def store(self, medium: str, hashes: Iterable[BlockHash], placeholder: bool) -> None:
        hashes = hashes if type(hashes) is list else list(hashes)
        fleet = self._fleet if self._fleet is not None else self._bound()
        fleet.store(self._slot, self.group, medium, hashes, placeholder)
        self.stored += len(hashes)

    def remove(self, medium: str, hashes: Iterable[BlockHash]) -> None:
        hashes = hashes if type(hashes) is list else list(hashes)
        fleet = self._fleet if self._fleet is not None else self._bound()
        removed, unknown = fleet.remove(self._slot, self.group, medium, hashes)
        self.removed += removed
        self.unknown_removals += unknown

    def demote(self) -> None:
        """A gap: what is held may have been removed unseen."""
        if self._fleet is not None:
            self._fleet.demote(self._slot, self.group)

    def clear(self) -> None:
        if self._fleet is not None:
            self._fleet.clear(self._slot, self.group)

    @property
    def trusted(self) -> _Layer:
        return _Layer(self, "trusted")

    @property
    def suspect(self) -> _Layer:
        return _Layer(self, "suspect")

    @property
    def placeholders(self) -> _Layer:
        return _Layer(self, "placeholder")

    def media(self) -> set[str]:
        f = self._fleet
        if f is None:
            return set()
        return {m for m in f.cell_media(self._slot, self.group) if any(f.cell_counts(self._slot, self.group, m)[:2])}

    def resident(self, medium: str) -> int:
        """Distinct trusted hashes in `medium`."""
        f = self._fleet
        return 0 if f is None else f.cell_counts(self._slot, self.group, medium)[0]

    def suspect_count(self, medium: str | None = None) -> int:
        f = self._fleet
        if f is None:
            return 0
        media = [medium] if medium is not None else f.cell_media(self._slot, self.group)
        return sum(f.cell_counts(self._slot, self.group, m)[1] for m in media)

    def count(self, medium: str, h: BlockHash, *, suspect: bool = False) -> int:
        """Copies of `h` held (trusted layer, or the suspect layer)."""
        f = self._fleet
        return 0 if f is None else f.copies(self._slot, self.group, medium, h, "suspect" if suspect else "trusted")

    def held(self, medium: str, h: BlockHash) -> int:
        """Copies of `h` held, trusted and suspect (`count` of both layers, in one lookup)."""
        f = self._fleet
        return 0 if f is None else f.held(self._slot, self.group, medium, h)

    def holds_all(self, medium: str, hashes: Sequence[BlockHash]) -> bool:
        """Whether every one of `hashes` has a copy in `medium`, trusted or suspect."""
        f = self._fleet
        return not hashes if f is None else f.holds_all(self._slot, self.group, medium, hashes)

    def held_columns(self, medium: str) -> Generator[None, None, HeldColumns]:
        """`medium` as a snapshot lists it, pausing now and then (`SlotStore.held_columns`)."""
        f = self._fleet
        if f is None:
            return HeldColumns([], [], [], [], [], [])
        return (yield from f.held_columns(self._slot, self.group, medium))

    def sample(self, medium: str, n: int) -> list[BlockHash]:
        """Up to `n` trusted hashes of `medium`, the first the group took
        (costs about `n` steps, not the tier's size)."""
        f = self._fleet
        return [] if f is None else f.first_trusted(self._slot, self.group, medium, n)

    def tables(self, media: Iterable[str] | None, include_suspect: bool) -> list[Table]:
        """The non-empty tables of the allowed media (what `prefix.match_view` reads)."""
        layers = ("trusted", "suspect") if include_suspect else ("trusted",)
        allowed = None if media is None else set(media)
        out: list[Table] = []
        for layer in layers:
            for medium, table in _Layer(self, layer).items():
                if (allowed is None or medium in allowed) and len(table):
                    out.append(table)
        return out


class _Groups(dict):
    """group → GroupResidency; putting a group in binds it to the view's slot,
    taking one out drops what it held."""

    __slots__ = ("_view",)

    def __init__(self, view: WorkerView) -> None:
        super().__init__()
        self._view = view

    def __setitem__(self, group: int, res: GroupResidency) -> None:
        old = self.get(group)
        if old is res:
            return
        if old is not None:
            self._view._release_group(old)
        self._view._adopt(group, res)
        super().__setitem__(group, res)

    def __delitem__(self, group: int) -> None:
        self._view._release_group(self[group])
        super().__delitem__(group)

    def pop(self, group: int, *default: Any) -> Any:
        if group in self:
            res = self[group]
            del self[group]
            return res
        if default:
            return default[0]
        raise KeyError(group)

    def popitem(self) -> tuple[int, GroupResidency]:
        group = next(reversed(self))
        return group, self.pop(group)

    def clear(self) -> None:
        for group in list(self):
            del self[group]

    def setdefault(self, group: int, res: GroupResidency | None = None) -> GroupResidency:
        if group not in self:
            assert res is not None
            self[group] = res
        return self[group]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for group, res in dict(*args, **kwargs).items():
            self[group] = res


class WorkerView:
    """Everything the index knows about one (worker, dp_rank)."""

    __slots__ = ("key", "epoch", "_groups", "topic", "last_seq", "last_ts", "last_received", "lag", "_watching",
                 "gaps", "restarts", "clears", "interruptions", "lost", "old_epoch_ignored", "messages",
                 "duplicates_ignored", "_fleet", "_slot", "_partial")

    def __init__(self, key: WorkerKey, epoch: int, fleet: SlotStore | None = None) -> None:
        self._fleet: SlotStore = fleet if fleet is not None else FleetResidency()
        self._slot = self._fleet.add_slot(key)
        self.key = key
        self.epoch = epoch  # 0: not known yet; the first one seen is adopted as is
        self._groups = _Groups(self)
        self.topic = ""
        self.last_seq: int | None = None
        self.last_ts = 0.0  # vLLM's ts of the last batch seen
        self.last_received = 0.0  # this process's clock at that moment
        self.lag: float | None = None  # received − vLLM ts, seconds
        self._watching = True
        self.gaps = 0
        self.restarts = 0
        self.clears = 0
        self.interruptions = 0
        self.lost: list[tuple[int, int]] = []
        self.old_epoch_ignored = 0
        self.duplicates_ignored = 0
        self.messages = 0
        self._partial = False

    @property
    def groups(self) -> dict[int, GroupResidency]:
        return self._groups

    @groups.setter
    def groups(self, value: Mapping[int, GroupResidency]) -> None:
        self._groups.clear()
        self._groups.update(value)

    @property
    def watching(self) -> bool:
        return self._watching

    @watching.setter
    def watching(self, value: bool) -> None:
        # The store's flag changes only here, so it equals ours: a message
        # to a view already watched (every message) costs no call.
        if value != self._watching:
            self._watching = value
            self._fleet.set_watching(self._slot, value)

    @property
    def slot(self) -> int:
        """This rank's slot in the index's store (its bit in the fleet structure)."""
        return self._slot

    @property
    def stale(self) -> bool:
        """Some entries are suspect (a gap or interruption since the last
        reset), or the view may lack part of its history (`partial`)."""
        return self._fleet.stale(self._slot)

    @property
    def partial(self) -> bool:
        """The view may lack part of the rank's history: it was bootstrapped
        with no snapshot, or from one that was itself partial. A record that
        empties the view and its groups (a fresh start, a restart) ends it;
        a clear does not: it empties the caches, but the groups the view never
        heard of stay unknown, and the prefix rule needs every group."""
        return self._partial

    @partial.setter
    def partial(self, value: bool) -> None:
        self._partial = value
        self._fleet.set_partial(self._slot, value)

    def reset(self, epoch: int) -> None:
        self.epoch = epoch
        self.groups = {}
        self.last_seq = None
        self.partial = False

    def group(self, group: int, kind: str, family: str) -> GroupResidency:
        found = self._groups.get(group)
        if found is None:
            found = GroupResidency(group, kind, family)
            self._groups[group] = found
        return found

    def release(self) -> None:
        """The view is dropped: free its slot (the view is unusable after)."""
        self._groups.clear()
        self._fleet.release(self._slot)

    def _adopt(self, group: int, res: GroupResidency) -> None:
        if res.group != group:
            raise ValueError(f"group {res.group} put under key {group}")
        if res._fleet is not None and (res._fleet is not self._fleet or res._slot != self._slot):
            if res._holds_anything():
                raise ValueError("a GroupResidency that holds blocks cannot move to another view")
        res._fleet, res._slot = self._fleet, self._slot
        self._fleet.set_shape(self._slot, group, res)

    def _release_group(self, res: GroupResidency) -> None:
        if res._fleet is self._fleet and res._slot == self._slot:
            self._fleet.clear(self._slot, res.group)
            self._fleet.drop_shape(self._slot, res.group)
            res._fleet, res._slot = None, -1

