"""Per worker rank, group and medium: each layer's hash → copies, as dicts.

The store of a reader that keeps a handful of ranks, the bridge's snapshot
keeper above all. The fleet structure (`bridge.residency.fleet`) interns every
hash as an id and keeps interned holder sets so that one query walks a chain
once for thousands of workers; for the few ranks of one worker that is work
and memory spent on a question nobody asks it. Here a store is one dict update
per hash. The rules that feed a store (`bridge.residency.index`) and the
prefix rule that reads it (`bridge.residency.prefix`) are the same for both:
this module only holds copies, with the slot interface `WorkerView` and
`GroupResidency` use (`views.SlotStore`).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from itertools import islice
from typing import cast

from bridge.contract import BlockHash
from bridge.residency.held_columns import HeldColumns, ones_left_out
from bridge.residency.prefix import GroupShape, HeldGroup, PrefixMatch, match_view, match_views
from bridge.residency.slots import WorkerKey

TRUSTED, SUSPECT, PLACEHOLDER = "trusted", "suspect", "placeholder"

# Entries a snapshot copies out of a layer's dict between two pauses (a C
# loop: tens of microseconds), and entries it looks up one by one (the
# hashes a rank holds in both layers after a gap: about a hundred).
COPY_STEP = 8192
LOOKUP_STEP = 2048


class _Cell:
    """One rank's tier: hash → copies per layer (a hash may have trusted and
    suspect copies at once; placeholders carry no position)."""

    __slots__ = ("trusted", "suspect", "placeholders")

    def __init__(self) -> None:
        self.trusted: dict[BlockHash, int] = {}
        self.suspect: dict[BlockHash, int] = {}
        self.placeholders: dict[BlockHash, int] = {}


class _Held:
    """A rank as `prefix.match_view` reads it."""

    __slots__ = ("key", "stale", "groups")

    def __init__(self, key: WorkerKey, stale: bool, groups: Mapping[int, HeldGroup]) -> None:
        self.key = key
        self.stale = stale
        self.groups = groups


class RankTables:
    """A few worker ranks' residency; `ResidencyIndex(store=RankTables())`."""

    def __init__(self) -> None:
        self._keys: dict[int, WorkerKey] = {}
        self._free: list[int] = []
        self._next = 0
        # slot → group → medium → cell; a tier has a cell from its first
        # store until its group is cleared (the fleet's cells do the same)
        self._cells: dict[int, dict[int, dict[str, _Cell]]] = {}
        self._shape: dict[int, dict[int, GroupShape]] = {}
        self._unwatched: set[int] = set()
        self._partial: set[int] = set()

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
        return any(cell.suspect for media in self._cells.get(slot, {}).values() for cell in media.values())

    def set_partial(self, slot: int, partial: bool) -> None:
        if partial:
            self._partial.add(slot)
        else:
            self._partial.discard(slot)

    def set_shape(self, slot: int, group: int, shape: GroupShape) -> None:
        self._shape.setdefault(slot, {})[group] = shape

    def drop_shape(self, slot: int, group: int) -> None:
        self._shape.get(slot, {}).pop(group, None)

    def reshape(self) -> None:
        """Shapes are read when asked: nothing is cached."""

    # -- feeding -----------------------------------------------------------

    def store(self, slot: int, group: int, medium: str, hashes: list[BlockHash], placeholder: bool = False) -> None:
        """One copy more of each hash (a BlockStored)."""
        media = self._cells[slot].get(group)
        if media is None:
            media = self._cells[slot][group] = {}
        cell = media.get(medium)
        if cell is None:
            cell = media[medium] = _Cell()
        table = cell.placeholders if placeholder else cell.trusted
        get = table.get
        for h in hashes:
            table[h] = get(h, 0) + 1

    def remove(self, slot: int, group: int, medium: str, hashes: list[BlockHash]) -> tuple[int, int]:
        """One copy less of each hash (a BlockRemoved): trusted first, then
        suspect, then placeholder. Returns (removed, unknown)."""
        cell = self._cells[slot].get(group, {}).get(medium)
        if cell is None:
            return 0, len(hashes)
        trusted, suspect, placeholders = cell.trusted, cell.suspect, cell.placeholders
        removed = 0
        for h in hashes:
            for table in (trusted, suspect, placeholders):
                c = table.get(h)
                if c:
                    if c == 1:
                        del table[h]
                    else:
                        table[h] = c - 1
                    removed += 1
                    break
        return removed, len(hashes) - removed

    def demote(self, slot: int, group: int) -> None:
        """A gap for this rank: its trusted copies in `group` become suspect."""
        for cell in self._cells[slot].get(group, {}).values():
            if not cell.trusted:
                continue
            suspect = cell.suspect
            if not suspect:
                cell.suspect, cell.trusted = cell.trusted, {}
                continue
            get = suspect.get
            for h, n in cell.trusted.items():
                suspect[h] = get(h, 0) + n
            cell.trusted = {}

    def demote_all(self) -> None:
        """This reader lost messages: every trusted copy of every rank becomes suspect."""
        for slot, groups in self._cells.items():
            for group in groups:
                self.demote(slot, group)

    def clear(self, slot: int, group: int) -> None:
        """Everything this rank holds in `group` goes (all layers)."""
        self._cells[slot].pop(group, None)

    # -- reading one rank ---------------------------------------------------

    def _cell(self, slot: int, group: int, medium: str) -> _Cell | None:
        return self._cells.get(slot, {}).get(group, {}).get(medium)

    def cell_media(self, slot: int, group: int) -> list[str]:
        return list(self._cells.get(slot, {}).get(group, {}))

    def cell_counts(self, slot: int, group: int, medium: str) -> tuple[int, int, int]:
        """(trusted, suspect, placeholder) of one rank's tier: distinct hashes
        with a trusted or a suspect copy, and placeholder copies."""
        cell = self._cell(slot, group, medium)
        if cell is None:
            return 0, 0, 0
        return len(cell.trusted), len(cell.suspect), sum(cell.placeholders.values())

    def copies(self, slot: int, group: int, medium: str, h: BlockHash, layer: str) -> int:
        # The residency rules ask this per store (report mode "full"): kept short.
        try:
            cell = self._cells[slot][group][medium]
        except KeyError:
            return 0
        if layer == TRUSTED:
            return cell.trusted.get(h, 0)
        return (cell.suspect if layer == SUSPECT else cell.placeholders).get(h, 0)

    def held(self, slot: int, group: int, medium: str, h: BlockHash) -> int:
        """Trusted and suspect copies of `h` together."""
        try:
            cell = self._cells[slot][group][medium]
        except KeyError:
            return 0
        n = cell.trusted.get(h, 0)
        return n + cell.suspect.get(h, 0) if cell.suspect else n

    def holds_all(self, slot: int, group: int, medium: str, hashes: Sequence[BlockHash]) -> bool:
        """Whether every one of `hashes` has a copy, trusted or suspect. A
        table never keeps a hash at zero copies: holding is membership,
        tested in C over a whole chain when nothing is suspect."""
        try:
            cell = self._cells[slot][group][medium]
        except KeyError:
            return not hashes
        trusted, suspect = cell.trusted, cell.suspect
        if not suspect:
            return all(map(trusted.__contains__, hashes))
        return all(h in trusted or h in suspect for h in hashes)

    def layer_items(self, slot: int, group: int, medium: str, layer: str) -> Iterator[tuple[BlockHash, int]]:
        cell = self._cell(slot, group, medium)
        return iter(()) if cell is None else iter(list(_layer(cell, layer).items()))

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
        trusted, suspect = cell.trusted, cell.suspect
        k = 0
        for h, t in trusted.items():
            k += 1
            if pause and not k % pause:
                yield None
            yield h, t, suspect.get(h, 0)
        for h, u in suspect.items():
            k += 1
            if pause and not k % pause:
                yield None
            if h not in trusted:
                yield h, 0, u

    def held_columns(self, slot: int, group: int, medium: str) -> Generator[None, None, HeldColumns]:
        """The tier as a snapshot lists it, in the order of `held_copies`:
        trusted hashes as they came; the suspect ones that are trusted too, in
        that order, then the suspect ones only; placeholders as they came.
        Pauses every `COPY_STEP` entries copied. The index must not change
        until the generator is done."""
        cell = self._cell(slot, group, medium)
        if cell is None:
            return HeldColumns([], [], [], [], [], [])
        trusted, suspect = cell.trusted, cell.suspect
        th: list[BlockHash] = []
        tn: list[int] = []
        yield from _copy_out(trusted, th, tn)
        sh: list[BlockHash] = []
        sn: list[int] = []
        if suspect:
            if trusted:
                keys = iter(trusted)
                while chunk := list(islice(keys, LOOKUP_STEP)):
                    both = [h for h in chunk if h in suspect]
                    sh.extend(both)
                    sn.extend(suspect[h] for h in both)
                    yield
                pairs = iter(suspect.items())
                while chunk_pairs := list(islice(pairs, LOOKUP_STEP)):
                    for h, n in chunk_pairs:
                        if h not in trusted:
                            sh.append(h)
                            sn.append(n)
                    yield
            else:
                yield from _copy_out(suspect, sh, sn)
        ph: list[BlockHash] = []
        pn: list[int] = []
        yield from _copy_out(cell.placeholders, ph, pn)
        return HeldColumns(th, ones_left_out(tn), sh, ones_left_out(sn), ph, ones_left_out(pn))

    def first_trusted(self, slot: int, group: int, medium: str, n: int) -> list[BlockHash]:
        """Up to `n` trusted hashes of a tier, oldest entry first."""
        cell = self._cell(slot, group, medium)
        out: list[BlockHash] = []
        if cell is None or n <= 0:
            return out
        for h in cell.trusted:
            out.append(h)
            if len(out) >= n:
                break
        return out

    @property
    def entries(self) -> int:
        """(rank, group, medium, hash) entries held, trusted or suspect."""
        n = 0
        for groups in self._cells.values():
            for media in groups.values():
                for cell in media.values():
                    n += len(cell.trusted.keys() | cell.suspect.keys()) if cell.suspect else len(cell.trusted)
        return n

    @property
    def hashes(self) -> int:
        """Distinct hashes held trusted or suspect (any rank, group, medium)."""
        held: set[BlockHash] = set()
        for groups in self._cells.values():
            for media in groups.values():
                for cell in media.values():
                    held.update(cell.trusted)
                    held.update(cell.suspect)
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


def _copy_out(table: dict[BlockHash, int], keys: list[BlockHash], values: list[int]) -> Generator[None, None, None]:
    """Appends the table's hashes and copies, `COPY_STEP` at a time with a pause after each."""
    ks, vs = iter(table), iter(table.values())
    while True:
        before = len(keys)
        keys.extend(islice(ks, COPY_STEP))
        values.extend(islice(vs, COPY_STEP))
        if len(keys) - before < COPY_STEP:
            return
        yield


def _layer(cell: _Cell, layer: str) -> dict[BlockHash, int]:
    if layer == TRUSTED:
        return cell.trusted
    return cell.suspect if layer == SUSPECT else cell.placeholders
