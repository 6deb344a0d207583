"""The fleet's residency, inverted: per kv_cache_group and medium, each block
hash's holders as one set, so a prefix query walks the request's chain once
whatever the number of workers (DESIGN §5; docs/consumers.md, "Index semantics").

Layout, chosen for memory and for the garbage collector (a fleet holds tens
of millions of entries, and a collector that walked them would stop the
process for a third of a second), one module per part:

- `hash_ids`: every hash gets a small int id, reused once nothing holds it;
  a stored chain is a few runs of consecutive ids.
- `slots`: every worker rank gets a slot; a set of slots is a bitset.
- `holder_sets`: holder sets interned and named by a set id (a "sid"),
  counted by reference.
- `tier_columns`: per (group, medium) an `array('I')` of sids by hash id,
  its trusted layer, and per group a union over media.
- `slot_logs`: per (slot, tier) a log of the ids the slot took: what a gap,
  a clear or a restart of one worker walks instead of the fleet.
- `query`: the hybrid rule for every candidate at once, as bitsets.
- `answers`: the bitsets as one `PrefixMatch` per worker, best first.

This module keeps them consistent: feeding (stores, removals, gaps, clears),
the slots and their shapes, and the figures a service reads.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Collection, Generator, Iterator, Sequence
from typing import NamedTuple

from bridge.contract import BlockHash
from bridge.residency import answers, query
from bridge.residency.cells import take_copy
from bridge.residency.hash_ids import HashIds
from bridge.residency.held_columns import ENTRY_STEP, HeldColumns, from_copies
from bridge.residency.holder_sets import HolderSets
from bridge.residency.prefix import GroupShape, PrefixMatch
from bridge.residency.slot_logs import SlotLog
from bridge.residency.slots import WorkerKey
from bridge.residency.tier_columns import Tier, TierColumns, zeros

TRUSTED, SUSPECT, PLACEHOLDER = "trusted", "suspect", "placeholder"


class ResidentCount(NamedTuple):
    """One worker rank's entries in one group and medium."""

    worker: str
    dp_rank: int
    group: int
    family: str
    medium: str
    trusted: int  # distinct hashes with a trusted copy
    suspect: int  # distinct hashes with a suspect copy
    placeholders: int  # window placeholder copies (no position)


class HashCount(NamedTuple):
    """One group (and medium, or None for any medium) across the fleet."""

    group: int
    medium: str | None
    hashes: int  # distinct hashes held by some worker
    shared: int  # ... by more than one worker rank
    entries: int  # (worker rank, hash) pairs; 0 on the any-medium rows (see the media rows)


class FleetResidency:
    """Every worker rank's residency, one structure for the fleet.

    `ResidencyIndex` feeds it and keeps the records' rules; a service can
    query it directly: `prefix_hits` for many workers at once, and
    `resident_counts` / `hash_counts` for aggregate figures (counters, no walk).
    """

    def __init__(self) -> None:
        self._sets = HolderSets()
        self._columns = TierColumns(self._sets, 1024)
        self._ids = HashIds(self._columns.grow, self._columns.cap)
        # slots
        self._keys: dict[int, WorkerKey] = {}  # in the order slots were taken (the index's view order)
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._suspect: list[int] = []  # per slot: entries with a suspect copy (stale while > 0)
        self._partial: set[int] = set()  # slots whose view may lack part of its history (+1 in _suspect)
        self._stale_version = 0  # moves whenever a count in _suspect does
        self._worker_bits: dict[str, int] = {}
        self._all = 0
        self._watching = 0
        self._shape: dict[int, dict[int, GroupShape]] = {}
        self._dirty = True
        self._widths: query.Widths = []
        self._templates: dict[int, dict[int, int]] = {}
        self._orders: dict[bool, answers.Order] = {}

    # -- slots -------------------------------------------------------------

    def add_slot(self, key: WorkerKey) -> int:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = self._next_slot
            self._next_slot += 1
            self._suspect.append(0)
        self._sets.add_slot(slot)
        b = self._sets.bits[slot]
        self._keys[slot] = key
        self._suspect[slot] = 0
        self._partial.discard(slot)
        self._stale_version += 1
        self._all |= b
        self._watching |= b
        self._worker_bits[key.worker] = self._worker_bits.get(key.worker, 0) | b
        self._orders.clear()
        return slot

    def release(self, slot: int) -> None:
        """Forget a slot entirely (its worker rank is gone)."""
        for tier in self._columns.tier_list:
            if slot in tier.cells:
                self._clear_tier(tier, slot)
        self._shape.pop(slot, None)
        key = self._keys.pop(slot)
        b = self._sets.bits[slot]
        self._all &= ~b
        self._watching &= ~b
        rest = self._worker_bits[key.worker] & ~b
        if rest:
            self._worker_bits[key.worker] = rest
        else:
            del self._worker_bits[key.worker]
        heapq.heappush(self._free_slots, slot)
        self._dirty = True
        self._orders.clear()

    def set_watching(self, slot: int, watching: bool) -> None:
        b = self._sets.bits[slot]
        now = self._watching | b if watching else self._watching & ~b
        if now != self._watching:
            self._watching = now
            self._orders.pop(False, None)

    def stale(self, slot: int) -> bool:
        return self._suspect[slot] > 0

    def set_partial(self, slot: int, partial: bool) -> None:
        """A view that may lack part of its history counts as stale, like one
        holding suspect copies: one extra suspect count while it lasts."""
        if partial != (slot in self._partial):
            self._suspect[slot] += 1 if partial else -1
            self._stale_version += 1
            if partial:
                self._partial.add(slot)
            else:
                self._partial.discard(slot)

    def set_shape(self, slot: int, group: int, shape: GroupShape) -> None:
        self._shape.setdefault(slot, {})[group] = shape
        self.reshape()

    def drop_shape(self, slot: int, group: int) -> None:
        self._shape.get(slot, {}).pop(group, None)
        self.reshape()

    def reshape(self) -> None:
        """A group's family, window or block size changed."""
        self._dirty = True
        self._orders.clear()

    # -- feeding -----------------------------------------------------------

    def _maybe_free(self, i: int) -> None:
        if not self._columns.held_anywhere(i):
            self._ids.forget(i)

    def _state(self, tier: Tier, i: int, slot: int) -> tuple[int, int]:
        """(trusted, suspect) copies of a held entry."""
        st = tier.extra.get((i, slot))
        if st is not None:
            return st
        return (1, 0) if self._sets.has(tier.trusted[i], slot) else (0, 1)

    def store(self, slot: int, group: int, medium: str, hashes: list[BlockHash], placeholder: bool = False) -> None:
        """One copy more of each hash (a BlockStored)."""
        tier = self._columns.tier(group, medium)
        cell = tier.cells.get(slot)
        if cell is None:
            cell = tier.cells[slot] = SlotLog()
        if placeholder:
            ph = tier.placeholders
            for h in hashes:
                key = (h, slot)
                ph[key] = ph.get(key, 0) + 1
            cell.placeholders += len(hashes)
            return
        ids = self._ids.intern(hashes)
        held = tier.held
        if tier.trusted is held:
            again: list[int] = []
            fresh = self._sets.join(tier, held, ids, slot, again)
            for i in again:
                self._copy(tier, cell, i, slot)
        else:
            fresh = []
            trusted = tier.trusted
            sets = self._sets
            for i in ids:
                sid = held[i]
                if sets.has(sid, slot):
                    self._copy(tier, cell, i, slot)
                else:
                    sets.put2(tier, held, trusted, i, sets.with_slot(sid, slot), sets.with_slot(trusted[i], slot))
                    fresh.append(i)
        if not fresh:
            return
        n = len(fresh)
        tier.entries += n
        cell.held += n
        cell.trusted += n
        if cell.took(fresh):
            cell.live(tier.held, slot, self._sets.S)
        grp = self._columns.groups[group]
        uh = grp.u_held
        if uh is not None:
            if grp.u_trusted is uh:
                self._sets.join(grp, uh, fresh, slot, None)
            else:
                for i in fresh:
                    self._columns.union_sync(grp, i, slot)

    def _copy(self, tier: Tier, cell: SlotLog, i: int, slot: int) -> None:
        """A further trusted copy of a held entry."""
        t, u = self._state(tier, i, slot)
        if not t:
            # suspect copies only: the tier has its own trusted column
            self._sets.put2(tier, tier.held, tier.trusted, i, tier.held[i], self._sets.with_slot(tier.trusted[i], slot))
            cell.trusted += 1
            grp = self._columns.groups[tier.group]
            if grp.u_held is not None:
                self._columns.union_sync(grp, i, slot)
        tier.extra[(i, slot)] = (t + 1, u)

    def remove(self, slot: int, group: int, medium: str, hashes: list[BlockHash]) -> tuple[int, int]:
        """One copy less of each hash (a BlockRemoved): trusted first, then
        suspect, then placeholder. Returns (removed, unknown)."""
        tier = self._columns.tiers.get((group, medium))
        cell = None if tier is None else tier.cells.get(slot)
        if cell is None:
            return 0, len(hashes)
        assert tier is not None
        held = tier.held
        get = self._ids.by_hash.get
        ph = tier.placeholders
        ss = 2 * slot + 1
        grp = self._columns.groups[group]
        fast = tier.trusted is held and grp.u_held is None
        S = self._sets.S
        sref = self._sets.sref
        b = self._sets.bits[slot]
        last_old = last_new = -1
        removed = unknown = 0
        for h in hashes:
            i = get(h)
            if i is not None:
                sid = held[i]
                if fast and (not tier.extra or (i, slot) not in tier.extra):
                    # the common cases: this slot's one trusted copy, no union to keep
                    if sid == ss:
                        held[i] = 0
                        tier.distinct -= 1
                        tier.entries -= 1
                        cell.held -= 1
                        cell.trusted -= 1
                        removed += 1
                        self._maybe_free(i)
                        continue
                    if sid and not sid & 1 and S[sid] & b:
                        if sid != last_old:
                            last_old = sid
                            last_new = self._sets.sid_of(S[sid] ^ b)
                        if last_new & 1:
                            tier.shared -= 1
                        else:
                            sref[last_new] += 1
                        held[i] = last_new
                        self._sets.release(sid)
                        tier.entries -= 1
                        cell.held -= 1
                        cell.trusted -= 1
                        removed += 1
                        continue
                if self._sets.has(sid, slot):
                    self._take(tier, cell, i, slot)
                    removed += 1
                    continue
            if ph and take_copy(ph, (h, slot)):
                cell.placeholders -= 1
                removed += 1
                continue
            unknown += 1
        return removed, unknown

    def _take(self, tier: Tier, cell: SlotLog, i: int, slot: int) -> None:
        key = (i, slot)
        st = tier.extra.pop(key, None)
        if st is None:
            was_trusted = self._sets.has(tier.trusted[i], slot)
            self._drop(tier, cell, i, slot)
            if was_trusted:
                cell.trusted -= 1
            else:
                self._unsuspect(tier, cell, slot)
            return
        t, u = st
        if t:
            t -= 1
            if not t:
                # suspect copies remain: the tier has its own trusted column
                self._sets.put2(tier, tier.held, tier.trusted, i, tier.held[i], self._sets.without(tier.trusted[i], slot))
                cell.trusted -= 1
                grp = self._columns.groups[tier.group]
                if grp.u_held is not None:
                    self._columns.union_sync(grp, i, slot)
        else:
            u -= 1
            if not u:
                self._unsuspect(tier, cell, slot)
        if t + u > 1:
            tier.extra[key] = (t, u)

    def _unsuspect(self, tier: Tier, cell: SlotLog, slot: int) -> None:
        cell.suspect -= 1
        self._suspect[slot] -= 1
        self._stale_version += 1
        tier.suspect_entries -= 1
        if not tier.suspect_entries:
            self._columns.realias(tier)

    def _drop(self, tier: Tier, cell: SlotLog, i: int, slot: int) -> None:
        """The entry's last copy is gone."""
        held = tier.held
        trusted = tier.trusted
        new_h = self._sets.without(held[i], slot)
        if trusted is held:
            self._sets.put(tier, held, i, new_h)
        else:
            t = trusted[i]
            self._sets.put2(tier, held, trusted, i, new_h, self._sets.without(t, slot) if self._sets.has(t, slot) else t)
        tier.entries -= 1
        cell.held -= 1
        grp = self._columns.groups[tier.group]
        if grp.u_held is not None:
            self._columns.union_sync(grp, i, slot)
        if not new_h:
            self._maybe_free(i)

    def demote(self, slot: int, group: int) -> None:
        """A gap for this worker rank: its trusted copies in `group` become suspect."""
        grp = self._columns.groups.get(group)
        if grp is None:
            return
        touched: list[int] = []
        for tier in grp.tiers.values():
            cell = tier.cells.get(slot)
            if cell is None or not cell.trusted:
                continue
            ids = cell.live(tier.held, slot, self._sets.S)
            if tier.trusted is tier.held:
                tier.trusted = array("I", tier.held)  # equal to held: owns nothing yet
            held, trusted = tier.held, tier.trusted
            extra = tier.extra
            fresh_suspect = 0
            for i in ids:
                t_sid = trusted[i]
                if not self._sets.has(t_sid, slot):
                    continue
                key = (i, slot)
                t, u = extra.get(key, (1, 0))
                self._sets.put2(tier, held, trusted, i, held[i], self._sets.without(t_sid, slot))
                if not u:
                    fresh_suspect += 1
                if t + u == 1:
                    extra.pop(key, None)
                else:
                    extra[key] = (0, t + u)
            cell.trusted = 0
            cell.suspect += fresh_suspect
            tier.suspect_entries += fresh_suspect
            self._suspect[slot] += fresh_suspect
            self._stale_version += 1
            touched += ids
        if grp.u_held is not None and touched:
            if grp.u_trusted is grp.u_held:
                grp.u_trusted = array("I", grp.u_held)
            for i in set(touched):
                self._columns.union_sync(grp, i, slot)

    def demote_all(self) -> None:
        """This consumer lost messages: every trusted copy of every worker becomes suspect."""
        for tier in self._columns.tier_list:
            if not tier.entries or all(not c.trusted for c in tier.cells.values()):
                continue
            extra = tier.extra
            for key, (t, u) in list(extra.items()):
                if t:
                    extra[key] = (0, t + u)
            for slot, cell in tier.cells.items():
                self._suspect[slot] += cell.held - cell.suspect
                self._stale_version += 1
                cell.suspect = cell.held
                cell.trusted = 0
            tier.suspect_entries = tier.entries
            if tier.trusted is not tier.held:
                self._columns.drop_own(tier.trusted, tier.held)
            tier.trusted = zeros(self._columns.cap)  # empty sets own nothing
        for grp in self._columns.groups.values():
            # no trusted copy is left anywhere: nor in the union
            if grp.u_held is not None and any(t.trusted is not t.held for t in grp.tiers.values()):
                if grp.u_trusted is not grp.u_held:
                    self._columns.drop_own(grp.u_trusted, grp.u_held)  # type: ignore[arg-type]
                grp.u_trusted = zeros(self._columns.cap)

    def clear(self, slot: int, group: int) -> None:
        """Everything this worker rank holds in `group` goes (all layers)."""
        grp = self._columns.groups.get(group)
        if grp is None:
            return
        for tier in list(grp.tiers.values()):
            if slot in tier.cells:
                self._clear_tier(tier, slot)

    def _clear_tier(self, tier: Tier, slot: int) -> None:
        cell = tier.cells[slot]
        if cell.placeholders:
            for key in [k for k in tier.placeholders if k[1] == slot]:
                del tier.placeholders[key]
        suspect = 0
        for i in cell.live(tier.held, slot, self._sets.S):
            t, u = self._state(tier, i, slot)
            tier.extra.pop((i, slot), None)
            if u:
                suspect += 1
            self._drop(tier, cell, i, slot)
        del tier.cells[slot]
        if suspect:
            self._suspect[slot] -= suspect
            self._stale_version += 1
            tier.suspect_entries -= suspect
            if not tier.suspect_entries:
                self._columns.realias(tier)

    # -- reading one worker -------------------------------------------------

    def cell_media(self, slot: int, group: int) -> list[str]:
        grp = self._columns.groups.get(group)
        return [] if grp is None else [m for m, t in grp.tiers.items() if slot in t.cells]

    def cell_counts(self, slot: int, group: int, medium: str) -> tuple[int, int, int]:
        """(trusted, suspect, placeholder) of one worker rank's tier."""
        tier = self._columns.tiers.get((group, medium))
        cell = None if tier is None else tier.cells.get(slot)
        return (0, 0, 0) if cell is None else (cell.trusted, cell.suspect, cell.placeholders)

    def _held_id(self, slot: int, group: int, medium: str, h: BlockHash) -> tuple[Tier, int] | None:
        """The tier and id of `h` when the slot holds it there, trusted or suspect."""
        tier = self._columns.tiers.get((group, medium))
        if tier is None:
            return None
        i = self._ids.by_hash.get(h)
        if i is None or not self._sets.has(tier.held[i], slot):
            return None
        return tier, i

    def copies(self, slot: int, group: int, medium: str, h: BlockHash, layer: str) -> int:
        if layer == PLACEHOLDER:
            tier = self._columns.tiers.get((group, medium))
            return 0 if tier is None else tier.placeholders.get((h, slot), 0)
        found = self._held_id(slot, group, medium, h)
        if found is None:
            return 0
        t, u = self._state(found[0], found[1], slot)
        return t if layer == TRUSTED else u

    def held(self, slot: int, group: int, medium: str, h: BlockHash) -> int:
        """Trusted and suspect copies of `h` together."""
        found = self._held_id(slot, group, medium, h)
        return 0 if found is None else sum(self._state(found[0], found[1], slot))

    def holds_all(self, slot: int, group: int, medium: str, hashes: Sequence[BlockHash]) -> bool:
        """Whether the slot holds a copy of every one of `hashes`, trusted or suspect."""
        return all(self.held(slot, group, medium, h) > 0 for h in hashes)

    def layer_items(self, slot: int, group: int, medium: str, layer: str) -> Iterator[tuple[BlockHash, int]]:
        tier = self._columns.tiers.get((group, medium))
        cell = None if tier is None else tier.cells.get(slot)
        if cell is None or tier is None:
            return
        if layer == PLACEHOLDER:
            for (h, s), c in list(tier.placeholders.items()):
                if s == slot:
                    yield h, c
            return
        for i in cell.live(tier.held, slot, self._sets.S):
            t, u = self._state(tier, i, slot)
            c = t if layer == TRUSTED else u
            if c:
                yield self._ids.hash_at(i), c

    def held_copies(self, slot: int, group: int, medium: str,
                    pause: int = 0) -> Iterator[tuple[BlockHash, int, int] | None]:
        """(hash, trusted copies, suspect copies) of every entry the slot holds
        in a tier, both layers in one pass; with `pause`, also None after
        every `pause` entries of the slot's log read (SlotLog.iter_live), so
        that a reader (a snapshot on the event loop) can pause at even
        intervals however few of them it keeps. The index must not change
        until the iterator is done."""
        tier = self._columns.tiers.get((group, medium))
        cell = None if tier is None else tier.cells.get(slot)
        if cell is None or tier is None:
            return
        state, hash_at = self._state, self._ids.hash_at
        for i in cell.iter_live(tier.held, slot, self._sets.S, pause):
            if i < 0:
                yield None
                continue
            t, u = state(tier, i, slot)
            yield hash_at(i), t, u

    def held_columns(self, slot: int, group: int, medium: str) -> Generator[None, None, HeldColumns]:
        """The tier as a snapshot lists it (`held_copies`, then the
        placeholders), pausing every `ENTRY_STEP` entries read."""
        return (yield from from_copies(self.held_copies(slot, group, medium, ENTRY_STEP),
                                       self.layer_items(slot, group, medium, PLACEHOLDER)))

    def first_trusted(self, slot: int, group: int, medium: str, n: int) -> list[BlockHash]:
        """Up to `n` hashes one worker rank holds trusted in a tier, in the
        order its log took them: a sample that costs about `n` steps, where
        `layer_items` lists the whole tier first."""
        tier = self._columns.tiers.get((group, medium))
        cell = None if tier is None else tier.cells.get(slot)
        out: list[BlockHash] = []
        if cell is None or tier is None or n <= 0:
            return out
        seen: set[int] = set()
        for i in cell.log:
            if i in seen:
                continue
            seen.add(i)
            if self._sets.has(tier.held[i], slot) and self._state(tier, i, slot)[0]:
                out.append(self._ids.hash_at(i))
                if len(out) >= n:
                    break
        return out

    # -- aggregate figures ----------------------------------------------------

    @property
    def hashes(self) -> int:
        """Distinct hashes held anywhere (any worker, group, medium)."""
        return len(self._ids)

    @property
    def holds_digests(self) -> bool:
        """Some hash is held in its 32-byte form: a chain of digests is then
        matched in both forms; else its int form alone says the same."""
        return self._ids.bytes_ids > 0

    @property
    def entries(self) -> int:
        """(worker rank, group, medium, hash) entries held, any layer."""
        return sum(t.entries for t in self._columns.tier_list)

    @property
    def holder_sets(self) -> int:
        """Distinct holder sets of two or more worker ranks in use."""
        return len(self._sets)

    def resident_counts(self) -> list[ResidentCount]:
        """Per worker rank, group and medium: what it holds. Counters only."""
        out = []
        for (group, medium), tier in sorted(self._columns.tiers.items()):
            for slot, cell in tier.cells.items():
                key = self._keys[slot]
                shape = self._shape.get(slot, {}).get(group)
                family = shape.family if shape is not None else "other"
                out.append(ResidentCount(key.worker, key.dp_rank, group, family, medium, cell.trusted, cell.suspect,
                                         cell.placeholders))
        return out

    def hash_counts(self) -> list[HashCount]:
        """Per group and medium, and per group over media (medium None):
        distinct hashes held, and those held by more than one worker rank."""
        out = []
        for group, grp in sorted(self._columns.groups.items()):
            for medium, tier in sorted(grp.tiers.items()):
                out.append(HashCount(group, medium, tier.distinct, tier.shared, tier.entries))
            if grp.u_held is not None:
                out.append(HashCount(group, None, grp.distinct, grp.shared, 0))
            elif grp.tiers:
                (tier,) = grp.tiers.values()
                out.append(HashCount(group, None, tier.distinct, tier.shared, 0))
        return out

    # -- queries -----------------------------------------------------------

    def _masks(self) -> query.Widths:
        """The widths by group (cached until a shape changes)."""
        if self._dirty:
            self._widths, slot_groups = query.widths_of(self._shape)
            self._templates = answers.templates_of(slot_groups)
            self._dirty = False
        return self._widths

    def answer(self, chain: Sequence[BlockHash], candidates: int, media: Collection[str] | None = None,
               include_suspect: bool = False) -> query.Answer:
        """The hybrid rule for every candidate slot at once."""
        return query.answer(self._ids, self._columns, self._sets.S, self._masks(), chain, candidates, media,
                            include_suspect)

    def _order(self, include_unwatched: bool) -> answers.Order:
        self._masks()
        got = self._orders.get(include_unwatched)
        if got is None:
            w = self._watching
            bits = self._sets.bits
            slots = [s for s in self._keys if include_unwatched or w & bits[s]]
            got = self._orders[include_unwatched] = answers.make_order(self._keys, slots, self._templates)
        answers.refresh_stale(got, self._stale_version, self._suspect)
        return got

    def longest_prefix(self, chain: Sequence[BlockHash], *, media: Collection[str] | None = None,
                       include_suspect: bool = False, include_unwatched: bool = False,
                       skip_workers: Collection[str] = ()) -> list[PrefixMatch]:
        """`ResidencyIndex.longest_prefix`: every candidate worker rank, best first."""
        order = self._order(include_unwatched)
        candidates = self._all if include_unwatched else self._watching
        skip = {w for w in skip_workers if w in self._worker_bits} if skip_workers else None
        if skip:
            for w in skip:
                candidates &= ~self._worker_bits[w]
        return answers.matches(order, self.answer(chain, candidates, media, include_suspect), candidates, skip)

    def match(self, slot: int, chain: Sequence[BlockHash], media: Collection[str] | None = None,
              include_suspect: bool = False) -> PrefixMatch:
        ans = self.answer(chain, self._sets.bits[slot], media, include_suspect)
        return answers.one_match(ans, slot, self._keys[slot], self._suspect[slot] > 0, self._templates.get(slot, {}))

    def prefix_hits(self, chain: Sequence[BlockHash], *, media: Collection[str] | None = None,
                    include_suspect: bool = False, include_unwatched: bool = False,
                    skip_workers: Collection[str] = (), min_blocks: int = 1) -> list[tuple[WorkerKey, int]]:
        """Worker ranks that can reuse at least `min_blocks` of the chain, with
        how many, deepest first (ties in slot order): the router's question,
        without one answer per worker of the fleet."""
        candidates = self._all if include_unwatched else self._watching
        for w in skip_workers:
            candidates &= ~self._worker_bits.get(w, 0)
        return answers.hits(self.answer(chain, candidates, media, include_suspect), self._keys, min_blocks)
