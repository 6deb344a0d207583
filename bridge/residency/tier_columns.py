"""Tier columns: per (group, medium), the holders of every hash id.

A tier is an `array('I')` indexed by hash id: the sid of its holders
(`holder_sets`), 4 bytes per hash, and the collector never looks inside.
The layers of the semantics: `held` names a slot while it has any copy,
`trusted` while it has a trusted copy; `trusted` *is* `held`, the same
array, until a gap makes something suspect, then a copy that owns a
reference only where it differs from `held`. Copy counts other than one live
in a small dict keyed (id, slot); window placeholders in one keyed (hash,
slot). Per group with several media, a union column over media answers the
default query (any medium) with one lookup per block.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection
from itertools import compress, count
from operator import ne

from bridge.contract import BlockHash
from bridge.residency.holder_sets import ColumnCounts, HolderSets
from bridge.residency.slot_logs import SlotLog


def zeros(n: int) -> array[int]:
    col = array("I")
    col.frombytes(bytes(col.itemsize * n))
    return col


class Tier(ColumnCounts):
    """One (group, medium) across the fleet."""

    __slots__ = ("group", "medium", "held", "trusted", "extra", "placeholders", "cells", "entries",
                 "suspect_entries")

    def __init__(self, group: int, medium: str, cap: int) -> None:
        super().__init__()
        self.group = group
        self.medium = medium
        self.held = zeros(cap)
        self.trusted = self.held  # its own array only while suspect copies exist
        self.extra: dict[tuple[int, int], tuple[int, int]] = {}  # (id, slot) → (trusted, suspect) copies, if not one
        self.placeholders: dict[tuple[BlockHash, int], int] = {}  # (hash, slot) → copies
        self.cells: dict[int, SlotLog] = {}
        self.entries = 0  # (id, slot) pairs held
        self.suspect_entries = 0  # (id, slot) pairs with a suspect copy


class Group(ColumnCounts):
    """One kv_cache_group index across the fleet: its tiers, and (with several
    media) their union, for queries that take any medium."""

    __slots__ = ("group", "tiers", "u_held", "u_trusted")

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group
        self.tiers: dict[str, Tier] = {}
        self.u_held: array[int] | None = None
        self.u_trusted: array[int] | None = None

    def sources(self, media: Collection[str] | None, include_suspect: bool) -> list[array[int]]:
        """The columns a query reads: the union when it covers the media asked."""
        tiers = self.tiers
        if media is None or (len(tiers) > 1 and all(m in media for m in tiers)):
            if self.u_held is not None:
                return [self.u_held if include_suspect else self.u_trusted]  # type: ignore[list-item]
            chosen = list(tiers.values())
        else:
            chosen = [t for m, t in tiers.items() if m in media]
        return [t.held if include_suspect else t.trusted for t in chosen]


class TierColumns:
    """Every group's tiers and unions, kept as long as the hash ids (`cap`)."""

    __slots__ = ("sets", "cap", "groups", "tiers", "tier_list")

    def __init__(self, sets: HolderSets, cap: int) -> None:
        self.sets = sets
        self.cap = cap
        self.groups: dict[int, Group] = {}
        self.tiers: dict[tuple[int, str], Tier] = {}
        self.tier_list: list[Tier] = []

    def tier(self, group: int, medium: str) -> Tier:
        """The tier, made on first use (a group's second medium starts its union)."""
        tier = self.tiers.get((group, medium))
        if tier is not None:
            return tier
        grp = self.groups.get(group)
        if grp is None:
            grp = self.groups[group] = Group(group)
        tier = Tier(group, medium, self.cap)
        if len(grp.tiers) == 1:
            # a second medium: the union starts as the first one
            (first,) = grp.tiers.values()
            hold = self.sets.hold
            grp.u_held = array("I", first.held)
            for sid in grp.u_held:
                hold(sid)
            grp.distinct, grp.shared = first.distinct, first.shared
            if first.trusted is first.held:
                grp.u_trusted = grp.u_held
            else:
                grp.u_trusted = array("I", first.trusted)
                for i in compress(count(), map(ne, grp.u_trusted, grp.u_held)):
                    hold(grp.u_trusted[i])
        grp.tiers[medium] = tier
        self.tiers[(group, medium)] = tier
        self.tier_list.append(tier)
        return tier

    def grow(self, cap: int) -> None:
        """Every column to `cap` entries (aliased columns grow once)."""
        for grp in self.groups.values():
            cols = [c for t in grp.tiers.values() for c in (t.held, t.trusted)]
            if grp.u_held is not None:
                cols += [grp.u_held, grp.u_trusted]  # type: ignore[list-item]
            for col in cols:
                if len(col) < cap:
                    col.frombytes(bytes(col.itemsize * (cap - len(col))))
        self.cap = cap

    def held_anywhere(self, i: int) -> bool:
        # a plain loop: this runs once per removed entry, where a generator's
        # set-up cost more than the look-ups (bench.index's ingest)
        for tier in self.tier_list:
            if tier.held[i]:
                return True
        return False

    def union_sync(self, grp: Group, i: int, slot: int) -> None:
        """The union's membership of (i, slot), from the group's tiers."""
        sets = self.sets
        has = sets.has
        uh = grp.u_held
        ut = grp.u_trusted
        assert uh is not None and ut is not None
        in_h = in_t = False
        for t in grp.tiers.values():
            if has(t.held[i], slot):
                in_h = True
                if has(t.trusted[i], slot):
                    in_t = True
                    break
        old_h = uh[i]
        new_h = old_h
        if has(old_h, slot) != in_h:
            new_h = sets.with_slot(old_h, slot) if in_h else sets.without(old_h, slot)
        if ut is uh:
            sets.put(grp, uh, i, new_h)
            return
        old_t = ut[i]
        new_t = old_t
        if has(old_t, slot) != in_t:
            new_t = sets.with_slot(old_t, slot) if in_t else sets.without(old_t, slot)
        if new_h != old_h or new_t != old_t:
            sets.put2(grp, uh, ut, i, new_h, new_t)

    def realias(self, tier: Tier) -> None:
        """No suspect copy left in the tier: trusted equals held again (and
        so owns no reference)."""
        tier.trusted = tier.held
        grp = self.groups[tier.group]
        if grp.u_held is not None and all(t.trusted is t.held for t in grp.tiers.values()):
            grp.u_trusted = grp.u_held

    def drop_own(self, t: array[int], h: array[int]) -> None:
        """Release what a trusted column owns (where it differs from held)."""
        drop = self.sets.drop
        for i in compress(count(), map(ne, t, h)):
            drop(t[i])
