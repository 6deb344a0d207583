"""Per worker rank, group and medium: each layer's hash → copies (`cells`).

The store of a reader that keeps a handful of ranks, the bridge's snapshot
keeper above all. The fleet structure (`bridge.residency.fleet`) interns every
hash as an id and keeps interned holder sets so that one query walks a chain
once for thousands of workers; for the few ranks of one worker that is work
and memory spent on a question nobody asks it. Here a store is one table
update per hash, in the native tier of `bridge.residency.cells` when built.
The rules that feed a store (`bridge.residency.index`) and the prefix rule
that reads it (`bridge.residency.prefix`) are the same for both: this module
only holds copies, with the slot interface `WorkerView` and `GroupResidency`
use (`views.SlotStore`).
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from itertools import chain, repeat
from types import MemberDescriptorType
from typing import TYPE_CHECKING, Any, cast

from bridge.contract import BlockHash
from bridge.contract.events import BlockRemoved, BlockStored
from bridge.residency.cells import NATIVE_CELL, Cell, CellLike, apply_run
from bridge.residency.cells import PLACEHOLDER as _PLACEHOLDER
from bridge.residency.cells import SUSPECT as _SUSPECT
from bridge.residency.cells import TRUSTED as _TRUSTED
from bridge.residency.held_columns import HeldColumns, ones_left_out
from bridge.residency.lean import LeanStored
from bridge.residency.prefix import GroupShape, HeldGroup, PrefixMatch, match_view, match_views
from bridge.residency.slots import WorkerKey

if TYPE_CHECKING:
    from bridge.residency.views import GroupResidency

TRUSTED, SUSPECT, PLACEHOLDER = "trusted", "suspect", "placeholder"

# Entries a snapshot copies out of a layer between two pauses (a C loop
# that makes each hash's object: about 0.2 ms), and entries it looks up one by one (the
# hashes a rank holds in both layers after a gap: about a hundred).
COPY_STEP = 8192
LOOKUP_STEP = 2048
# The event classes the native loop applies (any other goes to the index's
# loop), and the fields it reads of them: each class's member descriptor,
# so that it reads a field without looking it up by name (None: it does).
RUN_KINDS = (BlockRemoved, LeanStored, BlockStored)
_RUN_FIELD_NAMES = ("block_hashes", "medium", "block_size", "kv_cache_spec_sliding_window", "placeholder",
                    "parent_block_hash", "token_ids")


def run_fields(kinds: tuple[type, ...]) -> tuple[tuple[MemberDescriptorType | None, ...], ...]:
    """Per class, the member descriptors of the fields the native loop reads."""
    return tuple(tuple(d if isinstance(d := getattr(kind, name, None), MemberDescriptorType) else None
                       for name in _RUN_FIELD_NAMES) for kind in kinds)



class _Held:
    """A rank as `prefix.match_view` reads it."""

    __slots__ = ("key", "stale", "groups")

    def __init__(self, key: WorkerKey, stale: bool, groups: Mapping[int, HeldGroup]) -> None:
        self.key = key
        self.stale = stale
        self.groups = groups


class RankTables:
    """A few worker ranks' residency; `ResidencyIndex(store=RankTables())`.
    `cell`: the tier's type (`bridge.residency.cells`; the native one when built);
    `stores`: subclasses of `BlockStored` the native loop also reads itself
    (their exact class: the bridge's own relay form, say), not left to the
    index's loop event by event."""

    def __init__(self, cell: type[CellLike] = Cell, stores: tuple[type[BlockStored], ...] = ()) -> None:
        self._cell_type = cell
        if not all(isinstance(kind, type) and issubclass(kind, BlockStored) for kind in stores):
            raise TypeError("stores: subclasses of BlockStored")
        self._run_kinds = RUN_KINDS + tuple(kind for kind in stores if kind not in RUN_KINDS)
        self._run_fields = run_fields(self._run_kinds)
        # Over native cells, a message's events are applied by one native
        # loop (`run_events`); the index's own loop does it otherwise.
        self.native_runs = cell is NATIVE_CELL and apply_run is not None
        self._keys: dict[int, WorkerKey] = {}
        self._free: list[int] = []
        self._next = 0
        # slot → group → medium → cell; a tier has a cell from its first
        # store until its group is cleared (the fleet's cells do the same)
        self._cells: dict[int, dict[int, dict[str, CellLike]]] = {}
        self._shape: dict[int, dict[int, GroupShape]] = {}
        self._unwatched: set[int] = set()
        self._partial: set[int] = set()
        # Bumped whenever a group comes, goes or changes shape: what a
        # reader derived from the shapes is good while it stays the same.
        self.shapes = 0

    # -- slots -------------------------------------------------------------

    def add_slot(self, key: WorkerKey) -> int:
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = self._next
            self._next += 1
        self._keys[slot] = key
        self._cells[slot] = {}
        self._unwatched.discard(slot)
        self._partial.discard(slot)
        return slot

    def release(self, slot: int) -> None:
        self._cells.pop(slot, None)
        self._shape.pop(slot, None)
        del self._keys[slot]
        self._unwatched.discard(slot)
        self._partial.discard(slot)
        heapq.heappush(self._free, slot)

    def set_watching(self, slot: int, watching: bool) -> None:
        if watching:
            self._unwatched.discard(slot)
        else:
            self._unwatched.add(slot)

    def stale(self, slot: int) -> bool:
        if slot in self._partial:
            return True
        return any(cell.has_suspect() for media in self._cells.get(slot, {}).values() for cell in media.values())

    def set_partial(self, slot: int, partial: bool) -> None:
        if partial:
            self._partial.add(slot)
        else:
            self._partial.discard(slot)

    def set_shape(self, slot: int, group: int, shape: GroupShape) -> None:
        self._shape.setdefault(slot, {})[group] = shape
        self.shapes += 1

    def drop_shape(self, slot: int, group: int) -> None:
        self._shape.get(slot, {}).pop(group, None)
        self.shapes += 1

    def reshape(self) -> None:
        """A group's family, block size or window changed."""
        self.shapes += 1

    # -- feeding -----------------------------------------------------------

    def store(self, slot: int, group: int, medium: str, hashes: list[BlockHash], placeholder: bool = False) -> None:
        """One copy more of each hash (a BlockStored)."""
        media = self._cells[slot].get(group)
        if media is None:
            media = self._cells[slot][group] = {}
        cell = media.get(medium)
        if cell is None:
            cell = media[medium] = self._cell_type()
        cell.store(hashes, placeholder)

    def remove(self, slot: int, group: int, medium: str, hashes: list[BlockHash]) -> tuple[int, int]:
        """One copy less of each hash (a BlockRemoved): trusted first, then
        suspect, then placeholder. Returns (removed, unknown)."""
        cell = self._cells[slot].get(group, {}).get(medium)
        if cell is None:
            return 0, len(hashes)
        removed = cell.remove(hashes)
        return removed, len(hashes) - removed

    def demote(self, slot: int, group: int) -> None:
        """A gap for this rank: its trusted copies in `group` become suspect."""
        for cell in self._cells[slot].get(group, {}).values():
            cell.demote()

    def run_events(self, index: object, g: GroupResidency, family: int, events: list[Any], start: int,
                   memo: object, others: tuple[tuple[int, int, int], ...]) -> int:
        """`ResidencyIndex._apply_events` from `events[start]` on for group
        `g` (its `family` as `cells.FAMILY_CODES` numbers it), in native code
        (`native_runs`): returns the index of the event it left to the
        caller's own loop, or len(events) when done. `index`: the
        `ResidencyIndex` (whose `reannounced_ignored` it counts); `memo`: the
        batch position's parent-less stores; `others`: (number, family,
        window blocks or -1) of the rank's other ruled groups."""
        assert apply_run is not None
        return apply_run(self._cells[g._slot], g, g.group, family, events, start, memo, others, self._run_kinds,
                         index, self._run_fields)

    def demote_all(self) -> None:
        """This reader lost messages: every trusted copy of every rank becomes suspect."""
        for slot, groups in self._cells.items():
            for group in groups:
                self.demote(slot, group)

    def clear(self, slot: int, group: int) -> None:
        """Everything this rank holds in `group` goes (all layers)."""
        self._cells[slot].pop(group, None)

    # -- reading one rank ---------------------------------------------------

    def _cell(self, slot: int, group: int, medium: str) -> CellLike | None:
        return self._cells.get(slot, {}).get(group, {}).get(medium)

    def cell_media(self, slot: int, group: int) -> list[str]:
        return list(self._cells.get(slot, {}).get(group, {}))

    def cell_counts(self, slot: int, group: int, medium: str) -> tuple[int, int, int]:
        """(trusted, suspect, placeholder) of one rank's tier: distinct hashes
        with a trusted or a suspect copy, and placeholder copies."""
        cell = self._cell(slot, group, medium)
        return (0, 0, 0) if cell is None else cell.counts()

    def copies(self, slot: int, group: int, medium: str, h: BlockHash, layer: str) -> int:
        # The residency rules ask this per store (report mode "full"): kept short.
        try:
            cell = self._cells[slot][group][medium]
        except KeyError:
            return 0
        return cell.copies(h, _LAYERS[layer])

    def held(self, slot: int, group: int, medium: str, h: BlockHash) -> int:
        """Trusted and suspect copies of `h` together."""
        try:
            cell = self._cells[slot][group][medium]
        except KeyError:
            return 0
        return cell.held(h)

    def holds_all(self, slot: int, group: int, medium: str, hashes: Sequence[BlockHash]) -> bool:
        """Whether every one of `hashes` has a copy, trusted or suspect (a
        table never keeps a hash at zero copies: holding is membership)."""
        try:
            cell = self._cells[slot][group][medium]
        except KeyError:
            return not hashes
        return cell.holds_all(hashes)

    def layer_items(self, slot: int, group: int, medium: str, layer: str) -> Iterator[tuple[BlockHash, int]]:
        cell = self._cell(slot, group, medium)
        if cell is None:
            return iter(())
        hashes, copies, _ = cell.chunk(_LAYERS[layer], 0, sys.maxsize)
        return zip(hashes, copies)

    def held_copies(self, slot: int, group: int, medium: str,
                    pause: int = 0) -> Iterator[tuple[BlockHash, int, int] | None]:
        """(hash, trusted copies, suspect copies) of every hash the rank holds
        in a tier: its trusted hashes in the order they came, then those only
        suspect; with `pause`, also None after every `pause` hashes, so that a
        reader (a snapshot on the event loop) can pause at even intervals.
        The index must not change until the iterator is done."""
        cell = self._cell(slot, group, medium)
        if cell is None:
            return
        trusted, trusted_n, _ = cell.chunk(_TRUSTED, 0, sys.maxsize)
        suspect_n = cell.counts_of(_SUSPECT, trusted)
        only, only_n, _ = cell.suspect_only(0, sys.maxsize)
        k = 0
        for h, t, u in chain(zip(trusted, trusted_n, suspect_n), zip(only, repeat(0), only_n)):
            k += 1
            if pause and not k % pause:
                yield None
            yield h, t, u

    def held_columns(self, slot: int, group: int, medium: str) -> Generator[None, None, HeldColumns]:
        """The tier as a snapshot lists it, in the order of `held_copies`:
        trusted hashes as they came; the suspect ones that are trusted too, in
        that order, then the suspect ones only; placeholders as they came.
        Pauses every `COPY_STEP` entries copied. The index must not change
        until the generator is done."""
        cell = self._cell(slot, group, medium)
        if cell is None:
            return HeldColumns([], [], [], [], [], [])
        th: list[BlockHash] = []
        tn: list[int] = []
        yield from _copy_out(cell, _TRUSTED, th, tn)
        sh: list[BlockHash] = []
        sn: list[int] = []
        if cell.has_suspect():
            if th:
                for i in range(0, len(th), LOOKUP_STEP):
                    piece = th[i:i + LOOKUP_STEP]
                    for h, n in zip(piece, cell.counts_of(_SUSPECT, piece)):
                        if n:
                            sh.append(h)
                            sn.append(n)
                    yield
                at = 0
                while at >= 0:
                    only, only_n, at = cell.suspect_only(at, LOOKUP_STEP)
                    sh.extend(only)
                    sn.extend(only_n)
                    yield
            else:
                yield from _copy_out(cell, _SUSPECT, sh, sn)
        ph: list[BlockHash] = []
        pn: list[int] = []
        yield from _copy_out(cell, _PLACEHOLDER, ph, pn)
        return HeldColumns(th, ones_left_out(tn), sh, ones_left_out(sn), ph, ones_left_out(pn))

    def first_trusted(self, slot: int, group: int, medium: str, n: int) -> list[BlockHash]:
        """Up to `n` trusted hashes of a tier, oldest entry first."""
        cell = self._cell(slot, group, medium)
        if cell is None or n <= 0:
            return []
        return cell.chunk(_TRUSTED, 0, n)[0]

    @property
    def entries(self) -> int:
        """(rank, group, medium, hash) entries held, trusted or suspect."""
        return sum(cell.entries() for groups in self._cells.values() for media in groups.values()
                   for cell in media.values())

    @property
    def hashes(self) -> int:
        """Distinct hashes held trusted or suspect (any rank, group, medium)."""
        held: set[BlockHash] = set()
        for groups in self._cells.values():
            for media in groups.values():
                for cell in media.values():
                    for layer in (_TRUSTED, _SUSPECT):
                        held.update(cell.chunk(layer, 0, sys.maxsize)[0])
        return len(held)

    # -- queries (the prefix rule, one rank at a time) -----------------------

    def _held(self, slot: int) -> _Held:
        groups = cast("Mapping[int, HeldGroup]", self._shape.get(slot, {}))
        return _Held(self._keys[slot], self.stale(slot), groups)

    def longest_prefix(self, chain: Sequence[BlockHash], *, media: Collection[str] | None = None,
                       include_suspect: bool = False, include_unwatched: bool = False,
                       skip_workers: Collection[str] = ()) -> list[PrefixMatch]:
        """`ResidencyIndex.longest_prefix`: every candidate rank, best first."""
        held = [self._held(slot) for slot, key in self._keys.items()
                if (include_unwatched or slot not in self._unwatched) and key.worker not in skip_workers]
        return match_views(held, chain, media, include_suspect)

    def match(self, slot: int, chain: Sequence[BlockHash], media: Collection[str] | None = None,
              include_suspect: bool = False) -> PrefixMatch:
        return match_view(self._held(slot), chain, media, include_suspect)


_LAYERS = {TRUSTED: _TRUSTED, SUSPECT: _SUSPECT, PLACEHOLDER: _PLACEHOLDER}


def _copy_out(cell: CellLike, layer: int, keys: list[BlockHash], values: list[int]) -> Generator[None, None, None]:
    """Appends a layer's hashes and copies, `COPY_STEP` at a time with a pause after each."""
    at = 0
    while True:
        ks, vs, at = cell.chunk(layer, at, COPY_STEP)
        keys.extend(ks)
        values.extend(vs)
        if at < 0:
            return
        yield
