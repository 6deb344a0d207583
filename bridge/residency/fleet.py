"""The fleet's residency, inverted: per kv_cache_group and medium, each block
hash's holders as one set, so a prefix query walks the request's chain once
whatever the number of workers (DESIGN §5; docs/consumers.md, "Index semantics").

Layout, chosen for memory and for the garbage collector (a fleet holds tens
of millions of entries, and a collector that walked them would stop the
process for a third of a second):

- Every hash gets a small int id (`_ids`: hash → id; id → hash in tuples of
  256, which the collector stops tracking as they hold only ints and bytes);
  ids are freed and reused when nothing holds the hash any more (`_idstate`
  marks a freed id until then: its tuple still names the old hash). New
  hashes take consecutive ids, so a stored chain is a few runs of ids; an
  int hash of 64 bits is also kept in an `array('Q')` by id (`_n64`), for
  comparing runs with a request in C. Ints and bytes are kept apart (a
  bytes query also looks up its int form, never the reverse), as
  `bridge.residency.hashes` says.
- Every worker rank gets a slot; a set of slots is a bitset (a Python int).
  Holder sets are interned in one table and named by a set id, a "sid": 0 is
  nobody, 2s+1 is slot s alone, even sids are the shared sets, counted by
  reference and reused when no column names them.
- A tier (group, medium) is an `array('I')` indexed by hash id: the sid of
  its holders. 4 bytes per hash, and the collector never looks inside.
- The layers of the semantics: `held` names a slot while it has any copy,
  `trusted` while it has a trusted copy; `trusted` *is* `held`, the same
  array, until a gap makes something suspect, then a copy that owns a
  reference only where it differs from `held`. Copy counts other than one
  live in a small dict keyed (id, slot); window placeholders in one keyed
  (hash, slot).
- Per group with several media, a union column over media answers the
  default query (any medium) with one lookup per block.
- Per (slot, tier) a log of the ids the slot took (4 bytes each, compacted):
  what a gap, a clear or a restart of one worker walks instead of the fleet.

A query turns the chain into runs of consecutive ids (one dict lookup per
run, the run's names compared with the chain a tuple at a time; after the
first unknown block, one `isdisjoint` pass), each group's column into runs
of equal holder sets (slices of the column, equal sets being equal sids,
changes found by XOR over the slice as one big int), and applies the hybrid
rule (`bridge.residency.prefix`) per width: attention = the whole run from
block 0, window = its last k blocks, state = the block itself. Work per
block is a few C-level passes; work per worker only where a worker's answer
is not 0, except building the answers (one `PrefixMatch` each, untracked by
the collector), whose limits come from the classes of equal limits.
"""

from __future__ import annotations

import heapq
import re
from array import array
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from functools import partial
from itertools import accumulate, compress, count, repeat
from operator import add, and_, is_, ne, or_, truth
from typing import Any, NamedTuple, Protocol, cast

from bridge.contract import ATTENTION, STATE, WINDOW, BlockHash
from bridge.residency.prefix import PrefixMatch, window_blocks
from bridge.residency.views import WorkerKey

# _BITS[s] is 1 << s, one object per slot.
_BITS: list[int] = []
_ALL = -1  # every bit
_BIN01 = bytes.maketrans(b"01", b"\x00\x01")
TRUSTED, SUSPECT, PLACEHOLDER = "trusted", "suspect", "placeholder"
_SHIFT = 8
_CHUNK = 1 << _SHIFT
_MASK = _CHUNK - 1
_U64 = 1 << 64
_NONZERO = re.compile(rb"[^\x00]")
_FEW = 16  # non-zero bytes of a run's changes found one search at a time


def _bit(slot: int) -> int:
    while len(_BITS) <= slot:
        _BITS.append(1 << len(_BITS))
    return _BITS[slot]


def _slots(bits: int) -> list[int]:
    """The slots of a bitset, any order."""
    if bits.bit_count() <= 16:
        out = []
        while bits:
            s = bits.bit_length() - 1
            out.append(s)
            bits ^= _BITS[s]
        return out
    return list(compress(count(), _flags(bits)))


def _flags(bits: int) -> bytes:
    """A bitset as one byte per slot (1 where set), up to its highest slot."""
    return bin(bits)[:1:-1].encode().translate(_BIN01)


def _int_key(h: BlockHash) -> BlockHash:
    return int.from_bytes(h[-8:], "big") if type(h) is bytes else h


def _zeros(n: int) -> array[int]:
    col = array("I")
    col.frombytes(bytes(col.itemsize * n))
    return col


class GroupShape(Protocol):
    """What the rule needs to know about one worker's group (a GroupResidency)."""

    family: str
    window: int | None
    block_size: int


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


class _Cell:
    """One slot's share of one tier: the ids it took (checked against the
    tier when read) and its counts."""

    __slots__ = ("log", "held", "trusted", "suspect", "placeholders")

    def __init__(self) -> None:
        self.log = array("I")
        self.held = 0  # ids with any copy
        self.trusted = 0  # ... with a trusted copy
        self.suspect = 0  # ... with a suspect copy
        self.placeholders = 0  # placeholder copies


class _Column:
    """Counts of a held column: hashes with a holder, hashes with two or more."""

    __slots__ = ("distinct", "shared")

    def __init__(self) -> None:
        self.distinct = 0
        self.shared = 0


class _Tier(_Column):
    """One (group, medium) across the fleet."""

    __slots__ = ("group", "medium", "held", "trusted", "extra", "placeholders", "cells", "entries",
                 "suspect_entries")

    def __init__(self, group: int, medium: str, cap: int) -> None:
        super().__init__()
        self.group = group
        self.medium = medium
        self.held = _zeros(cap)
        self.trusted = self.held  # its own array only while suspect copies exist
        self.extra: dict[tuple[int, int], tuple[int, int]] = {}  # (id, slot) → (trusted, suspect) copies, if not one
        self.placeholders: dict[tuple[BlockHash, int], int] = {}  # (hash, slot) → copies
        self.cells: dict[int, _Cell] = {}
        self.entries = 0  # (id, slot) pairs held
        self.suspect_entries = 0  # (id, slot) pairs with a suspect copy


class _Group(_Column):
    """One kv_cache_group index across the fleet: its tiers, and (with several
    media) their union, for queries that take any medium."""

    __slots__ = ("group", "tiers", "u_held", "u_trusted")

    def __init__(self, group: int) -> None:
        super().__init__()
        self.group = group
        self.tiers: dict[str, _Tier] = {}
        self.u_held: array[int] | None = None
        self.u_trusted: array[int] | None = None

    def sources(self, media: Collection[str] | None, include_suspect: bool) -> list[array[int]]:
        tiers = self.tiers
        if media is None or (len(tiers) > 1 and all(m in media for m in tiers)):
            if self.u_held is not None:
                return [self.u_held if include_suspect else self.u_trusted]  # type: ignore[list-item]
            chosen = list(tiers.values())
        else:
            chosen = [t for m, t in tiers.items() if m in media]
        return [t.held if include_suspect else t.trusted for t in chosen]


class _Answer:
    """One query's result, as bitsets: blocks and per-group limits by level."""

    __slots__ = ("blocks", "limits")

    def __init__(self) -> None:
        self.blocks: list[tuple[int, int]] = []  # (blocks, slots), deepest first, blocks > 0
        self.limits: list[tuple[int, list[tuple[int, int]]]] = []  # (group, [(limit, slots)])


class _Order(NamedTuple):
    """The candidates of a query in the index's order (cached until slots or shapes change)."""

    slots: list[int]
    workers: list[str]
    ranks: list[int]
    templates: list[dict[int, int]]  # per position: every group's limit 0 (shared, copied on the way out)
    pos: dict[int, int]  # slot → position
    ident: bool  # position == slot
    by_template: list[tuple[dict[int, int], int]]  # (template, its slots)
    stale: list[Any]  # [_stale_version it was computed at, per position: stale]


def _limit_classes(ans: _Answer, candidates: int) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    """The slots with some limit not 0, split by their limits: (slots, ((group, limit), ...))."""
    parts: list[tuple[int, tuple[tuple[int, int], ...]]] = [(candidates, ())]
    for group, lv in ans.limits:
        nonzero = [(v, b) for v, b in lv if v]
        if not nonzero:
            continue
        split = []
        for bits, assign in parts:
            rest = bits
            for v, b in nonzero:
                x = bits & b
                if x:
                    split.append((x, (*assign, (group, v))))
                    rest &= ~x
            if rest:
                split.append((rest, assign))
        parts = split
    return [(bits, assign) for bits, assign in parts if assign]


class FleetResidency:
    """Every worker rank's residency, one structure for the fleet.

    `ResidencyIndex` feeds it and keeps the records' rules; a service can
    query it directly: `prefix_hits` for many workers at once, and
    `resident_counts` / `hash_counts` for aggregate figures (counters, no walk).
    """

    def __init__(self) -> None:
        self._ids: dict[BlockHash, int] = {}
        # id → hash, in tuples of _CHUNK (id 0 is never a hash: unknown blocks look it up)
        self._chunks: list[tuple[BlockHash | None, ...]] = []
        self._next_id = 1
        self._free: list[int] = []
        self._cap = 1024
        # Per id: 0 free (a freed id's chunk keeps the old name), 1 live with
        # an int hash of 64 bits (its value in _n64), 2 live with another.
        self._idstate = bytearray(self._cap)
        self._n64 = array("Q", bytes(8 * self._cap))
        self._int_ids = 0
        self._bytes_ids = 0
        # holder sets: sid → bitset, bitset → even sid, references of even sids
        self._S: list[int] = [0]
        self._sid: dict[int, int] = {}
        self._sref: list[int] = [0]
        self._free_sids: list[int] = []
        self._next_even = 2
        self._groups: dict[int, _Group] = {}
        self._tiers: dict[tuple[int, str], _Tier] = {}
        self._tier_list: list[_Tier] = []
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
        self._widths: list[tuple[int, list[tuple[int | None, int]]]] = []
        self._slot_groups: dict[int, tuple[int, ...]] = {}
        self._templates: dict[int, dict[int, int]] = {}
        self._orders: dict[bool, _Order] = {}

    # -- holder sets ---------------------------------------------------------

    def _grow_sets(self, n: int) -> None:
        if len(self._S) < n:
            more = n - len(self._S)
            self._S.extend(repeat(0, more))
            self._sref.extend(repeat(0, more))

    def _set_sid(self, v: int) -> int:
        """The sid of a non-empty bitset (a new shared set starts unreferenced)."""
        if not v & (v - 1):
            return 2 * v.bit_length() - 1
        sid = self._sid.get(v)
        if sid is None:
            if self._free_sids:
                sid = self._free_sids.pop()
            else:
                sid = self._next_even
                self._next_even += 2
                self._grow_sets(sid + 1)
            self._S[sid] = v
            self._sid[v] = sid
        return sid

    def _release(self, sid: int) -> None:
        r = self._sref[sid] - 1
        if r:
            self._sref[sid] = r
        else:
            self._sref[sid] = 0
            del self._sid[self._S[sid]]
            self._S[sid] = 0
            self._free_sids.append(sid)

    def _with(self, sid: int, slot: int) -> int:
        if not sid:
            return 2 * slot + 1
        return self._set_sid(self._S[sid] | _BITS[slot])

    def _without(self, sid: int, slot: int) -> int:
        if sid == 2 * slot + 1:
            return 0
        return self._set_sid(self._S[sid] & ~_BITS[slot])

    def _hput(self, owner: _Column, col: array[int], i: int, new: int) -> None:
        """A column that holds its sids (held, union held): col[i] = new."""
        old = col[i]
        if old == new:
            return
        new_shared = new and not new & 1
        old_shared = old and not old & 1
        if new_shared:
            self._sref[new] += 1
        col[i] = new
        if not old:
            owner.distinct += 1
        elif not new:
            owner.distinct -= 1
        if new_shared and not old_shared:
            owner.shared += 1
        elif old_shared and not new_shared:
            owner.shared -= 1
        if old_shared:
            self._release(old)

    def _put2(self, owner: _Column, h: array[int], t: array[int], i: int, new_h: int, new_t: int) -> None:
        """held h and trusted t (t may be h) at i become new_h and new_t. A
        separate trusted column holds a reference only where it differs from h."""
        if t is h:
            self._hput(owner, h, i, new_h)
            return
        old_h = h[i]
        old_t = t[i]
        if new_t != new_h and new_t and not new_t & 1:
            self._sref[new_t] += 1
        self._hput(owner, h, i, new_h)
        t[i] = new_t
        if old_t != old_h and old_t and not old_t & 1:
            self._release(old_t)

    def _has(self, sid: int, slot: int) -> bool:
        return sid == 2 * slot + 1 or bool(sid and not sid & 1 and self._S[sid] & _BITS[slot])

    # -- slots -------------------------------------------------------------

    def add_slot(self, key: WorkerKey) -> int:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = self._next_slot
            self._next_slot += 1
            self._suspect.append(0)
        b = _bit(slot)
        self._grow_sets(2 * slot + 2)
        self._S[2 * slot + 1] = b
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
        for tier in self._tier_list:
            if slot in tier.cells:
                self._clear_tier(tier, slot)
        self._shape.pop(slot, None)
        key = self._keys.pop(slot)
        b = _BITS[slot]
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
        b = _BITS[slot]
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

    def _tier(self, group: int, medium: str) -> _Tier:
        tier = self._tiers.get((group, medium))
        if tier is not None:
            return tier
        grp = self._groups.get(group)
        if grp is None:
            grp = self._groups[group] = _Group(group)
        tier = _Tier(group, medium, self._cap)
        if len(grp.tiers) == 1:
            # a second medium: the union starts as the first one
            (first,) = grp.tiers.values()
            grp.u_held = array("I", first.held)
            for sid in grp.u_held:
                if sid and not sid & 1:
                    self._sref[sid] += 1
            grp.distinct, grp.shared = first.distinct, first.shared
            if first.trusted is first.held:
                grp.u_trusted = grp.u_held
            else:
                grp.u_trusted = array("I", first.trusted)
                for i in compress(count(), map(ne, grp.u_trusted, grp.u_held)):
                    sid = grp.u_trusted[i]
                    if sid and not sid & 1:
                        self._sref[sid] += 1
        grp.tiers[medium] = tier
        self._tiers[(group, medium)] = tier
        self._tier_list.append(tier)
        return tier

    def _grow(self, need: int) -> None:
        cap = max(need, self._cap + (self._cap >> 2) + 1024)
        pad = bytes(4 * (cap - self._cap))
        seen: set[int] = set()
        for grp in self._groups.values():
            cols = [c for t in grp.tiers.values() for c in (t.held, t.trusted)]
            if grp.u_held is not None:
                cols += [grp.u_held, grp.u_trusted]  # type: ignore[list-item]
            for col in cols:
                if id(col) not in seen:
                    seen.add(id(col))
                    col.frombytes(pad)
        self._idstate += bytes(cap - self._cap)
        self._n64.frombytes(bytes(8 * (cap - self._cap)))
        self._cap = cap

    def _intern(self, hashes: list[BlockHash]) -> list[int]:
        get = self._ids.get
        ids = list(map(get, hashes))
        if None not in ids:
            return ids  # type: ignore[return-value]
        where = list(compress(count(), map(is_, ids, repeat(None))))
        missing = list(map(hashes.__getitem__, where))
        if len(set(missing)) != len(missing):  # a hash twice in one store: one at a time
            for j in where:
                i = get(hashes[j])
                ids[j] = i if i is not None else self._new_ids([hashes[j]])[0]
            return ids  # type: ignore[return-value]
        for j, i in zip(where, self._new_ids(missing)):
            ids[j] = i
        return ids  # type: ignore[return-value]

    def _new_ids(self, hashes: list[BlockHash]) -> list[int]:
        """Ids for hashes not interned (distinct): freed ones first, then new."""
        free = self._free
        k = min(len(free), len(hashes))
        out = free[len(free) - k:]
        del free[len(free) - k:]
        if k:
            self._name(out, hashes)
            self._mark(out, hashes)
        if k < len(hashes):
            start = self._next_id
            self._next_id += len(hashes) - k
            out += range(start, self._next_id)
            if self._next_id > self._cap:
                self._grow(self._next_id)
            self._name_run(start, hashes[k:])
            fresh = hashes[k:]
            try:
                values = array("Q", cast(list[int], fresh))
            except (TypeError, OverflowError):
                self._mark(range(start, self._next_id), fresh)
            else:
                self._n64[start:self._next_id] = values
                self._idstate[start:self._next_id] = b"\x01" * len(fresh)
        self._ids.update(zip(hashes, out))
        kinds = set(map(type, hashes))
        if kinds == {int}:
            self._int_ids += len(hashes)
        elif kinds == {bytes}:
            self._bytes_ids += len(hashes)
        else:
            nb = sum(1 for h in hashes if type(h) is bytes)
            self._bytes_ids += nb
            self._int_ids += len(hashes) - nb
        return out

    def _mark(self, ids: Iterable[int], hashes: list[BlockHash]) -> None:
        """_idstate and _n64 for ids just named."""
        state, n64 = self._idstate, self._n64
        for i, h in zip(ids, hashes):
            if isinstance(h, int) and 0 <= h < _U64:
                n64[i] = h
                state[i] = 1
            else:
                state[i] = 2

    def _hash_at(self, i: int) -> BlockHash:
        return self._chunks[i >> _SHIFT][i & _MASK]  # type: ignore[return-value]

    def _name(self, ids: list[int], hashes: list[BlockHash]) -> None:
        """id → hash for these ids: each chunk touched is rebuilt once."""
        chunks = self._chunks
        need = (max(ids) >> _SHIFT) + 1
        if len(chunks) < need:
            chunks.extend(repeat((None,) * _CHUNK, need - len(chunks)))
        by: dict[int, list[tuple[int, BlockHash]]] = {}
        for i, h in zip(ids, hashes):
            by.setdefault(i >> _SHIFT, []).append((i & _MASK, h))
        for j, changes in by.items():
            names = list(chunks[j])
            for k, h in changes:
                names[k] = h
            chunks[j] = tuple(names)

    def _name_run(self, start: int, hashes: list[BlockHash]) -> None:
        """id → hash for the new ids start, start+1, ...: chunk by chunk."""
        chunks = self._chunks
        need = ((start + len(hashes) - 1) >> _SHIFT) + 1
        if len(chunks) < need:
            chunks.extend(repeat((None,) * _CHUNK, need - len(chunks)))
        pos, i, n = 0, start, len(hashes)
        while pos < n:
            j, k = i >> _SHIFT, i & _MASK
            step = min(_CHUNK - k, n - pos)
            if step == _CHUNK:
                chunks[j] = tuple(hashes[pos:pos + step])
            else:
                names = list(chunks[j])
                names[k:k + step] = hashes[pos:pos + step]
                chunks[j] = tuple(names)
            pos += step
            i += step

    def _maybe_free(self, i: int) -> None:
        for tier in self._tier_list:
            if tier.held[i]:
                return
        h = self._hash_at(i)
        del self._ids[h]  # its chunk keeps the stale name until the id is reused
        self._free.append(i)
        self._idstate[i] = 0
        if type(h) is bytes:
            self._bytes_ids -= 1
        else:
            self._int_ids -= 1

    def _state(self, tier: _Tier, i: int, slot: int) -> tuple[int, int]:
        """(trusted, suspect) copies of a held entry."""
        st = tier.extra.get((i, slot))
        if st is not None:
            return st
        return (1, 0) if self._has(tier.trusted[i], slot) else (0, 1)

    def _union_sync(self, grp: _Group, i: int, slot: int) -> None:
        """The union's membership of (i, slot), from the group's tiers."""
        uh = grp.u_held
        ut = grp.u_trusted
        assert uh is not None and ut is not None
        in_h = in_t = False
        for t in grp.tiers.values():
            if self._has(t.held[i], slot):
                in_h = True
                if self._has(t.trusted[i], slot):
                    in_t = True
                    break
        old_h = uh[i]
        new_h = old_h
        if self._has(old_h, slot) != in_h:
            new_h = self._with(old_h, slot) if in_h else self._without(old_h, slot)
        if ut is uh:
            self._hput(grp, uh, i, new_h)
            return
        old_t = ut[i]
        new_t = old_t
        if self._has(old_t, slot) != in_t:
            new_t = self._with(old_t, slot) if in_t else self._without(old_t, slot)
        if new_h != old_h or new_t != old_t:
            self._put2(grp, uh, ut, i, new_h, new_t)

    def store(self, slot: int, group: int, medium: str, hashes: list[BlockHash], placeholder: bool = False) -> None:
        """One copy more of each hash (a BlockStored)."""
        tier = self._tier(group, medium)
        cell = tier.cells.get(slot)
        if cell is None:
            cell = tier.cells[slot] = _Cell()
        if placeholder:
            ph = tier.placeholders
            for h in hashes:
                key = (h, slot)
                ph[key] = ph.get(key, 0) + 1
            cell.placeholders += len(hashes)
            return
        ids = self._intern(hashes)
        held = tier.held
        if tier.trusted is held:
            again: list[int] = []
            fresh = self._join(tier, held, ids, slot, again)
            for i in again:
                self._copy(tier, cell, i, slot)
        else:
            fresh = []
            trusted = tier.trusted
            for i in ids:
                sid = held[i]
                if self._has(sid, slot):
                    self._copy(tier, cell, i, slot)
                else:
                    self._put2(tier, held, trusted, i, self._with(sid, slot), self._with(trusted[i], slot))
                    fresh.append(i)
        if not fresh:
            return
        n = len(fresh)
        tier.entries += n
        cell.held += n
        cell.trusted += n
        log = cell.log
        log.extend(fresh)
        if len(log) > 2 * cell.held + 64:
            self._live(tier, cell, slot)
        grp = self._groups[group]
        uh = grp.u_held
        if uh is not None:
            if grp.u_trusted is uh:
                self._join(grp, uh, fresh, slot, None)
            else:
                for i in fresh:
                    self._union_sync(grp, i, slot)

    def _join(self, owner: _Column, col: array[int], ids: list[int], slot: int, again: list[int] | None) -> list[int]:
        """The slot joins the holders at each id of a column that owns its
        sids; ids it is already at go to `again`. Consecutive blocks of a
        shared prefix make the same move, so it is computed once per run and
        the references are counted at the end. Returns the ids joined."""
        S = self._S
        b = _BITS[slot]
        ss = 2 * slot + 1
        fresh: list[int] = []
        take = fresh.append
        distinct = shared = 0
        last_old = last_new = -1
        gained: dict[int, int] = {}
        lost: dict[int, int] = {}
        for i in ids:
            sid = col[i]
            if not sid:
                col[i] = ss
                distinct += 1
                take(i)
                continue
            if sid == ss or (not sid & 1 and S[sid] & b):
                if again is not None:
                    again.append(i)
                continue
            if sid != last_old:
                last_old = sid
                last_new = self._set_sid(S[sid] | b)
            col[i] = last_new
            take(i)
            gained[last_new] = gained.get(last_new, 0) + 1
            if sid & 1:
                shared += 1
            else:
                lost[sid] = lost.get(sid, 0) + 1
        sref = self._sref
        for sid, c in gained.items():
            sref[sid] += c
        for sid, c in lost.items():
            r = sref[sid] - c
            if r:
                sref[sid] = r
            else:
                sref[sid] = 1
                self._release(sid)
        owner.distinct += distinct
        owner.shared += shared
        return fresh

    def _copy(self, tier: _Tier, cell: _Cell, i: int, slot: int) -> None:
        """A further trusted copy of a held entry."""
        t, u = self._state(tier, i, slot)
        if not t:
            # suspect copies only: the tier has its own trusted column
            self._put2(tier, tier.held, tier.trusted, i, tier.held[i], self._with(tier.trusted[i], slot))
            cell.trusted += 1
            grp = self._groups[tier.group]
            if grp.u_held is not None:
                self._union_sync(grp, i, slot)
        tier.extra[(i, slot)] = (t + 1, u)

    def remove(self, slot: int, group: int, medium: str, hashes: list[BlockHash]) -> tuple[int, int]:
        """One copy less of each hash (a BlockRemoved): trusted first, then
        suspect, then placeholder. Returns (removed, unknown)."""
        tier = self._tiers.get((group, medium))
        cell = None if tier is None else tier.cells.get(slot)
        if cell is None:
            return 0, len(hashes)
        assert tier is not None
        held = tier.held
        get = self._ids.get
        ph = tier.placeholders
        ss = 2 * slot + 1
        grp = self._groups[group]
        fast = tier.trusted is held and grp.u_held is None
        S = self._S
        sref = self._sref
        b = _BITS[slot]
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
                            last_new = self._set_sid(S[sid] ^ b)
                        if last_new & 1:
                            tier.shared -= 1
                        else:
                            sref[last_new] += 1
                        held[i] = last_new
                        self._release(sid)
                        tier.entries -= 1
                        cell.held -= 1
                        cell.trusted -= 1
                        removed += 1
                        continue
                if self._has(sid, slot):
                    self._take(tier, cell, i, slot)
                    removed += 1
                    continue
            if ph:
                key = (h, slot)
                c = ph.get(key)
                if c:
                    if c == 1:
                        del ph[key]
                    else:
                        ph[key] = c - 1
                    cell.placeholders -= 1
                    removed += 1
                    continue
            unknown += 1
        return removed, unknown

    def _take(self, tier: _Tier, cell: _Cell, i: int, slot: int) -> None:
        key = (i, slot)
        st = tier.extra.pop(key, None)
        if st is None:
            was_trusted = self._has(tier.trusted[i], slot)
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
                self._put2(tier, tier.held, tier.trusted, i, tier.held[i], self._without(tier.trusted[i], slot))
                cell.trusted -= 1
                grp = self._groups[tier.group]
                if grp.u_held is not None:
                    self._union_sync(grp, i, slot)
        else:
            u -= 1
            if not u:
                self._unsuspect(tier, cell, slot)
        if t + u > 1:
            tier.extra[key] = (t, u)

    def _unsuspect(self, tier: _Tier, cell: _Cell, slot: int) -> None:
        cell.suspect -= 1
        self._suspect[slot] -= 1
        self._stale_version += 1
        tier.suspect_entries -= 1
        if not tier.suspect_entries:
            self._realias(tier)

    def _realias(self, tier: _Tier) -> None:
        """No suspect copy left in the tier: trusted equals held again (and
        so owns no reference)."""
        tier.trusted = tier.held
        grp = self._groups[tier.group]
        if grp.u_held is not None and all(t.trusted is t.held for t in grp.tiers.values()):
            grp.u_trusted = grp.u_held

    def _drop(self, tier: _Tier, cell: _Cell, i: int, slot: int) -> None:
        """The entry's last copy is gone."""
        held = tier.held
        trusted = tier.trusted
        new_h = self._without(held[i], slot)
        if trusted is held:
            self._hput(tier, held, i, new_h)
        else:
            t = trusted[i]
            self._put2(tier, held, trusted, i, new_h, self._without(t, slot) if self._has(t, slot) else t)
        tier.entries -= 1
        cell.held -= 1
        grp = self._groups[tier.group]
        if grp.u_held is not None:
            self._union_sync(grp, i, slot)
        if not new_h:
            self._maybe_free(i)

    def _live(self, tier: _Tier, cell: _Cell, slot: int) -> list[int]:
        """The ids the slot holds in the tier (its log, checked and compacted)."""
        held = tier.held
        ss = 2 * slot + 1
        S = self._S
        b = _BITS[slot]
        ids = [i for i in set(cell.log) if held[i] == ss or (held[i] and not held[i] & 1 and S[held[i]] & b)]
        if len(cell.log) > len(ids) + 16:
            cell.log = array("I", ids)
        return ids

    def demote(self, slot: int, group: int) -> None:
        """A gap for this worker rank: its trusted copies in `group` become suspect."""
        grp = self._groups.get(group)
        if grp is None:
            return
        touched: list[int] = []
        for tier in grp.tiers.values():
            cell = tier.cells.get(slot)
            if cell is None or not cell.trusted:
                continue
            ids = self._live(tier, cell, slot)
            if tier.trusted is tier.held:
                tier.trusted = array("I", tier.held)  # equal to held: owns nothing yet
            held, trusted = tier.held, tier.trusted
            extra = tier.extra
            fresh_suspect = 0
            for i in ids:
                t_sid = trusted[i]
                if not self._has(t_sid, slot):
                    continue
                key = (i, slot)
                t, u = extra.get(key, (1, 0))
                self._put2(tier, held, trusted, i, held[i], self._without(t_sid, slot))
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
                self._union_sync(grp, i, slot)

    def _drop_own(self, t: array[int], h: array[int]) -> None:
        """Release what a trusted column owns (where it differs from held)."""
        for i in compress(count(), map(ne, t, h)):
            sid = t[i]
            if sid and not sid & 1:
                self._release(sid)

    def demote_all(self) -> None:
        """This consumer lost messages: every trusted copy of every worker becomes suspect."""
        for tier in self._tier_list:
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
                self._drop_own(tier.trusted, tier.held)
            tier.trusted = _zeros(self._cap)  # empty sets own nothing
        for grp in self._groups.values():
            # no trusted copy is left anywhere: nor in the union
            if grp.u_held is not None and any(t.trusted is not t.held for t in grp.tiers.values()):
                if grp.u_trusted is not grp.u_held:
                    self._drop_own(grp.u_trusted, grp.u_held)  # type: ignore[arg-type]
                grp.u_trusted = _zeros(self._cap)

    def clear(self, slot: int, group: int) -> None:
        """Everything this worker rank holds in `group` goes (all layers)."""
        grp = self._groups.get(group)
        if grp is None:
            return
        for tier in list(grp.tiers.values()):
            if slot in tier.cells:
                self._clear_tier(tier, slot)

    def _clear_tier(self, tier: _Tier, slot: int) -> None:
        cell = tier.cells[slot]
        if cell.placeholders:
            for key in [k for k in tier.placeholders if k[1] == slot]:
                del tier.placeholders[key]
        suspect = 0
        for i in self._live(tier, cell, slot):
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
                self._realias(tier)

    # -- reading one worker -------------------------------------------------

    def cell_media(self, slot: int, group: int) -> list[str]:
        grp = self._groups.get(group)
        return [] if grp is None else [m for m, t in grp.tiers.items() if slot in t.cells]

    def cell_counts(self, slot: int, group: int, medium: str) -> tuple[int, int, int]:
        """(trusted, suspect, placeholder) of one worker rank's tier."""
        tier = self._tiers.get((group, medium))
        cell = None if tier is None else tier.cells.get(slot)
        return (0, 0, 0) if cell is None else (cell.trusted, cell.suspect, cell.placeholders)

    def copies(self, slot: int, group: int, medium: str, h: BlockHash, layer: str) -> int:
        tier = self._tiers.get((group, medium))
        if tier is None:
            return 0
        if layer == PLACEHOLDER:
            return tier.placeholders.get((h, slot), 0)
        i = self._ids.get(h)
        if i is None or not self._has(tier.held[i], slot):
            return 0
        t, u = self._state(tier, i, slot)
        return t if layer == TRUSTED else u

    def layer_items(self, slot: int, group: int, medium: str, layer: str) -> Iterator[tuple[BlockHash, int]]:
        tier = self._tiers.get((group, medium))
        cell = None if tier is None else tier.cells.get(slot)
        if cell is None or tier is None:
            return
        if layer == PLACEHOLDER:
            for (h, s), c in list(tier.placeholders.items()):
                if s == slot:
                    yield h, c
            return
        for i in self._live(tier, cell, slot):
            t, u = self._state(tier, i, slot)
            c = t if layer == TRUSTED else u
            if c:
                yield self._hash_at(i), c  # type: ignore[misc]

    def first_trusted(self, slot: int, group: int, medium: str, n: int) -> list[BlockHash]:
        """Up to `n` hashes one worker rank holds trusted in a tier, in the
        order its log took them: a sample that costs about `n` steps, where
        `layer_items` lists the whole tier first."""
        tier = self._tiers.get((group, medium))
        cell = None if tier is None else tier.cells.get(slot)
        out: list[BlockHash] = []
        if cell is None or tier is None or n <= 0:
            return out
        seen: set[int] = set()
        for i in cell.log:
            if i in seen:
                continue
            seen.add(i)
            if self._has(tier.held[i], slot) and self._state(tier, i, slot)[0]:
                out.append(self._hash_at(i))
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
        return self._bytes_ids > 0

    @property
    def entries(self) -> int:
        """(worker rank, group, medium, hash) entries held, any layer."""
        return sum(t.entries for t in self._tier_list)

    @property
    def holder_sets(self) -> int:
        """Distinct holder sets of two or more worker ranks in use."""
        return len(self._sid)

    def resident_counts(self) -> list[ResidentCount]:
        """Per worker rank, group and medium: what it holds. Counters only."""
        out = []
        for (group, medium), tier in sorted(self._tiers.items()):
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
        for group, grp in sorted(self._groups.items()):
            for medium, tier in sorted(grp.tiers.items()):
                out.append(HashCount(group, medium, tier.distinct, tier.shared, tier.entries))
            if grp.u_held is not None:
                out.append(HashCount(group, None, grp.distinct, grp.shared, 0))
            elif grp.tiers:
                (tier,) = grp.tiers.values()
                out.append(HashCount(group, None, tier.distinct, tier.shared, 0))
        return out

    # -- queries -----------------------------------------------------------

    def _masks(self) -> list[tuple[int, list[tuple[int | None, int]]]]:
        """Per group: (width, slots) for every width the rule gives that group
        in some worker: None = from block 0 (attention; window of unknown
        size), k = the last k blocks (window), 1 = the block itself (state)."""
        if not self._dirty:
            return self._widths
        widths: dict[int, dict[int | None, int]] = {}
        slot_groups: dict[int, tuple[int, ...]] = {}
        for slot, groups in self._shape.items():
            b = _BITS[slot]
            mine = []
            for group, shape in groups.items():
                family = shape.family
                k: int | None
                if family == ATTENTION:
                    k = None
                elif family == STATE:
                    k = 1
                elif family == WINDOW:
                    k = window_blocks(shape.window, shape.block_size)
                else:
                    continue
                per = widths.setdefault(group, {})
                per[k] = per.get(k, 0) | b
                mine.append(group)
            slot_groups[slot] = tuple(sorted(mine))
        self._widths = [(g, list(ks.items())) for g, ks in sorted(widths.items())]
        self._slot_groups = slot_groups
        shared: dict[tuple[int, ...], dict[int, int]] = {}  # one template per set of groups (never handed out)
        self._templates = {s: shared.setdefault(gs, dict.fromkeys(gs, 0)) for s, gs in slot_groups.items()}
        self._dirty = False
        return self._widths

    def _lookup(self, chain: Sequence[BlockHash]) -> tuple[list[list[int]], int]:
        """The chain as id lists (one, or two when bytes may be held in int
        form too), cut after the last block anything holds; and that length."""
        get = self._ids.get
        lists = [list(map(get, chain, repeat(0)))]
        if self._int_ids and bytes in set(map(type, chain)):
            alt = list(map(get, map(_int_key, chain), repeat(0)))
            lists = [lists[0], alt] if self._bytes_ids else [alt]
        n = 0
        for ids in lists:
            r = next(compress(count(), reversed(ids)), None)
            if r is not None:
                n = max(n, len(ids) - r)
        return [ids[:n] for ids in lists], n

    def _runs(self, chain: tuple[BlockHash, ...]) -> tuple[list[tuple[int, int, int]], int] | None:
        """The chain as runs (position, first id, length) of consecutive live
        ids, cut after the last block anything holds, and that length; None
        when a bytes block may be held in its int form (`_lookup` then).

        Ids are handed out in the order hashes arrive, so a stored chain is a
        few runs: one dict lookup per run, its names checked a chunk at a
        time; after the first unknown block, one `isdisjoint` pass over the
        rest, and a lookup per block only if that finds something."""
        n_full = len(chain)
        q64: array[int] | None = None  # the chain as ints of 64 bits, if it is
        if self._int_ids and n_full:
            try:
                q64 = array("Q", cast(Sequence[int], chain))
            except (TypeError, OverflowError):
                if bytes in set(map(type, chain)):
                    return None
        get = self._ids.get
        runs: list[tuple[int, int, int]] = []
        j = 0
        while j < n_full:
            i = get(chain[j])
            if i is None:
                end = j + 1
                for j in self._maybe_known(chain, end) if end < n_full else ():
                    if j >= end and (i := get(chain[j])) is not None:
                        length = self._run_length(chain, q64, j, i)
                        runs.append((j, i, length))
                        end = j + length
                break
            length = self._run_length(chain, q64, j, i)
            runs.append((j, i, length))
            j += length
        if not runs:
            return runs, 0
        j, _, length = runs[-1]
        return runs, j + length

    def _run_length(self, chain: tuple[BlockHash, ...], q64: array[int] | None, j: int, i: int) -> int:
        """How many blocks from chain[j] (whose id is i) have the ids i, i+1, ...:
        live ids whose hashes equal the blocks (as the dict finds them). With
        the chain as ints of 64 bits (q64), two arrays compared; else the
        names, a tuple at a time."""
        m = min(len(chain) - j, self._next_id - i)
        state = self._idstate
        if q64 is not None:
            # ids of other hashes cannot equal these blocks: the run ends there
            stop = [x for x in (state.find(0, i, i + m), state.find(2, i, i + m)) if x >= 0]
            if stop:
                m = max(1, min(stop) - i)
            return 1 + _equal_prefix(q64, j + 1, self._n64, i + 1, m - 1)
        d = state.find(0, i, i + m)
        if d >= 0:
            m = d - i
        chunks = self._chunks
        length = 1
        while length < m:
            a = i + length
            off = a & _MASK
            step = min(_CHUNK - off, m - length)
            names = chunks[a >> _SHIFT]
            part = names if step == _CHUNK else names[off:off + step]
            mine = chain[j + length:j + length + step]
            if mine != part:
                return length + next(compress(count(), map(ne, mine, part)))
            length += step
        return length

    def _maybe_known(self, chain: tuple[BlockHash, ...], start: int) -> Iterable[int]:
        """The positions from `start` on whose blocks are known, in order
        (`isdisjoint` first: a tail of unknown blocks is one pass in C)."""
        rest = chain[start:]
        if self._ids.keys().isdisjoint(rest):
            return ()
        return compress(count(start), map(self._ids.__contains__, rest))

    def _run_segments(self, src: array[int], runs: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
        """`_segments` of one column read along id runs: (starts, sids). Each
        run is a slice of the column: one set when it equals that set repeated
        (a memcmp); otherwise XOR-ed with itself shifted by one entry (as one
        big int), a non-zero entry where the next one differs."""
        starts: list[int] = []
        sids: list[int] = []
        last = -1
        end = 0
        size = src.itemsize
        for j, i, length in runs:
            if j > end and last:
                starts.append(end)
                sids.append(0)
                last = 0
            end = j + length
            part = src[i:end - j + i]
            v = part[0]
            if part == array(part.typecode, (v,)) * length:
                if v != last:
                    starts.append(j)
                    sids.append(v)
                    last = v
                continue
            x = int.from_bytes(part, "little")  # entry t is bytes t*size.. whatever the machine's order
            x = (x ^ (x >> (8 * size))) & ((1 << (8 * size * (length - 1))) - 1)
            changes = x.to_bytes(length * size, "little")
            offs = [0]
            if len(changes) - changes.count(0) <= _FEW:  # a few changes: one search each
                at = 0
                search = _NONZERO.search
                while found := search(changes, at):
                    t = found.start() // size + 1  # a new set from entry t
                    offs.append(t)
                    at = t * size
            else:  # many: one byte per entry (the OR of its bytes), all at once
                for k in range(1, size):
                    x |= x >> (8 * k)
                offs += compress(count(1), x.to_bytes(length * size, "little")[::size])
            vs = list(map(part.__getitem__, offs))
            if vs[0] == last:
                del offs[0], vs[0]
            starts += map(add, offs, repeat(j)) if j else offs
            sids += vs
            last = sids[-1]
        return starts, sids

    @staticmethod
    def _run_ids(runs: list[tuple[int, int, int]], n: int) -> list[int]:
        ids = [0] * n
        for j, i, length in runs:
            ids[j:j + length] = range(i, i + length)
        return ids

    def _column(self, group: int, id_lists: list[list[int]], media: Collection[str] | None,
                include_suspect: bool) -> tuple[list[int] | None, bool]:
        """The group's holders along the chain, and whether as sids (one
        source: equal sets are equal sids) or as bitsets (an OR of several)."""
        grp = self._groups.get(group)
        if grp is None:
            return None, False
        cols = [list(map(src.__getitem__, ids)) for src in grp.sources(media, include_suspect) for ids in id_lists]
        if not cols:
            return None, False
        if len(cols) == 1:
            return cols[0], True
        S = self._S
        col = list(map(S.__getitem__, cols[0]))
        for other in cols[1:]:
            col = list(map(or_, col, map(S.__getitem__, other)))
        return col, False

    def answer(self, chain: Sequence[BlockHash], candidates: int, media: Collection[str] | None = None,
               include_suspect: bool = False) -> _Answer:
        """The hybrid rule for every candidate slot at once."""
        n_full = len(chain)
        widths = self._masks()
        ans = _Answer()
        groups: list[tuple[int, int, list[tuple[int, list[int], list[int]]],
                          list[tuple[int, list[int], list[int], list[int] | None]], int]] = []
        levels: list[list[tuple[int, int]]] = []
        cons_all = 0
        id_lists: list[list[int]] | None = None
        runs: list[tuple[int, int, int]] | None = None
        looked = False
        n = 0
        S = self._S
        for group, ks in widths:
            masks = [(k, m & candidates) for k, m in ks if m & candidates]
            if not masks:
                continue
            if not looked:
                looked = True
                got = self._runs(chain if type(chain) is tuple else tuple(chain))
                if got is None:
                    id_lists, n = self._lookup(chain)
                else:
                    runs, n = got
            grp = self._groups.get(group)
            dense: Callable[[], list[int]] | None = None
            # the segments' holders: sids (seg_sets is S) or bitsets (seg_sets None)
            seg_sets: list[int] | None = None
            if runs is not None and n and grp is not None and len(srcs := grp.sources(media, include_suspect)) == 1:
                seg_starts, seg_x = self._run_segments(srcs[0], runs)
                seg_sets = S
                dense = partial(_dense_runs, srcs[0], runs, n, S)
            else:
                if runs is not None and id_lists is None:
                    id_lists = [self._run_ids(runs, n)]
                col, sids = self._column(group, id_lists, media, include_suspect) if n else (None, False)  # type: ignore[arg-type]
                seg_starts, seg_x = _segments(col, n, None)
                if sids:
                    seg_sets = S
                if col is not None:
                    dense = partial(_dense_col, col, S if sids else None)
            seg_vals: list[int] | None = None
            entries = []
            points = []
            merged: dict[int, int] = {}
            cons = 0
            for k, m in masks:
                cons |= m
                if k == 1:
                    # the block itself: read the segments where asked, no pieces
                    points.append((m, seg_starts, seg_x, seg_sets))
                    lv = _levels_points(seg_starts, seg_x, seg_sets, n, n_full, m)
                else:
                    if seg_vals is None:
                        seg_vals = seg_x if seg_sets is None else list(map(seg_sets.__getitem__, seg_x))
                    starts, vals = _pieces(seg_starts, seg_vals, n, n_full, k, dense)
                    entries.append((m, starts, vals))
                    lv = _levels(starts, vals, n_full, m)
                for value, bits in lv:
                    merged[value] = merged.get(value, 0) | bits
            groups.append((group, candidates & ~cons, entries, points, n))
            lv = sorted(merged.items(), reverse=True)
            levels.append(lv)
            ans.limits.append((group, lv))
            cons_all |= cons
        if not groups:
            return ans
        # The deepest p each worker's groups all allow is at most the least of
        # its groups' limits: levels of that bound, deepest first.
        values = sorted({v for lv in levels for v, _ in lv if v > 0}, reverse=True)
        ge = [0] * len(groups)
        ptr = [0] * len(groups)
        bound: list[tuple[int, int]] = []
        prev = 0
        for v in values:
            u = cons_all
            for gi, lv in enumerate(levels):
                p = ptr[gi]
                acc = ge[gi]
                while p < len(lv) and lv[p][0] >= v:
                    acc |= lv[p][1]
                    p += 1
                ptr[gi], ge[gi] = p, acc
                u &= acc | groups[gi][1]
            if u != prev:
                bound.append((v, u ^ prev))
                prev = u
        # Sweep down from the deepest bound: where every group's allowed set is
        # constant, one test settles every pending worker.
        li = 0
        pending = 0
        p = bound[0][0] if bound else 0
        while p >= 1:
            while li < len(bound) and bound[li][0] >= p:
                pending |= bound[li][1]
                li += 1
            if not pending:
                if li >= len(bound):
                    break
                p = bound[li][0]
                continue
            ok = pending
            lo = 0
            for _, free, entries, points, n in groups:
                allowed = free
                for m, starts, vals in entries:
                    j = bisect_right(starts, p) - 1
                    allowed |= vals[j] & m
                    if starts[j] > lo:
                        lo = starts[j]
                for m, seg_starts, seg_x, seg_sets in points:
                    # the piece of p is the segment of block p - 1 (after n: nobody)
                    if p > n:
                        if n + 1 > lo:
                            lo = n + 1
                        continue
                    j = bisect_right(seg_starts, p - 1) - 1
                    x = seg_x[j]
                    allowed |= (x if seg_sets is None else seg_sets[x]) & m
                    if seg_starts[j] + 1 > lo:
                        lo = seg_starts[j] + 1
                ok &= allowed
            if ok:
                ans.blocks.append((p, ok))
                pending ^= ok
            p = lo - 1
        return ans

    def _per_slot(self, ans: _Answer) -> tuple[dict[int, int], dict[int, dict[int, int]]]:
        """Per slot: blocks (only where > 0), limits (only where one is not 0)."""
        blocks: dict[int, int] = {}
        for p, bits in ans.blocks:
            blocks.update(zip(_slots(bits), repeat(p)))
        limits: dict[int, dict[int, int]] = {}
        templates = self._templates
        for group, lv in ans.limits:
            for v, bits in lv:
                if v:
                    for s in _slots(bits):
                        d = limits.get(s)
                        if d is None:
                            d = limits[s] = templates[s].copy()
                        d[group] = v
        return blocks, limits

    def _order(self, include_unwatched: bool) -> _Order:
        self._masks()
        got = self._orders.get(include_unwatched)
        if got is None:
            w = self._watching
            slots = [s for s in self._keys if include_unwatched or w & _BITS[s]]
            keys = [self._keys[s] for s in slots]
            empty: dict[int, int] = {}
            templates = [self._templates.get(s, empty) for s in slots]
            by_template: dict[int, tuple[dict[int, int], int]] = {}
            for s, t in zip(slots, templates):
                had = by_template.get(id(t), (t, 0))
                by_template[id(t)] = (t, had[1] | _BITS[s])
            got = _Order(slots, [k.worker for k in keys], [k.dp_rank for k in keys], templates,
                         dict(zip(slots, count())), slots == list(range(len(slots))), list(by_template.values()),
                         [-1, []])
            self._orders[include_unwatched] = got
        if got.stale[0] != self._stale_version:
            got.stale[:] = [self._stale_version, list(map(truth, map(self._suspect.__getitem__, got.slots)))]
        return got

    def longest_prefix(self, chain: Sequence[BlockHash], *, media: Collection[str] | None = None,
                       include_suspect: bool = False, include_unwatched: bool = False,
                       skip_workers: Collection[str] = ()) -> list[PrefixMatch]:
        """`ResidencyIndex.longest_prefix`: every candidate worker rank, best first."""
        order = self._order(include_unwatched)
        slots, workers, ranks, templates, pos = order.slots, order.workers, order.ranks, order.templates, order.pos
        ident = order.ident
        stale: list[bool] = order.stale[1]
        candidates = self._all if include_unwatched else self._watching
        skip = {w for w in skip_workers if w in self._worker_bits} if skip_workers else None
        if skip:
            for w in skip:
                candidates &= ~self._worker_bits[w]
            keep = [j for j, w in enumerate(workers) if w not in skip]
            slots = [slots[j] for j in keep]
            workers = [workers[j] for j in keep]
            ranks = [ranks[j] for j in keep]
            templates = [templates[j] for j in keep]
            stale = [stale[j] for j in keep]
            pos = dict(zip(slots, count()))
            ident = False
        ans = self.answer(chain, candidates, media, include_suspect)
        # Per position in the index's order: blocks, and the limits to copy
        # (the shared template unless a group's limit is not 0).
        depth = [0] * len(slots) if ans.blocks else []
        first: list[int] = []  # positions with blocks > 0: deepest first, ties in order
        for p, bits in ans.blocks:
            at = sorted(_slots(bits) if ident else map(pos.__getitem__, _slots(bits)))
            for q in at:
                depth[q] = p
            first += at
        blocks: Iterable[int] = depth if first else repeat(0)
        classes = _limit_classes(ans, candidates)
        limits: Iterable[dict[int, int]] = templates
        if not classes:
            pass
        elif ident and len(order.by_template) == 1 and len(classes) < 256:
            # one template: per position the number of its class (0: none), as bytes
            t = order.by_template[0][0]
            table = [t]
            which = 0
            for c, (bits, assign) in enumerate(classes, 1):
                d = t.copy()
                d.update(assign)
                table.append(d)
                which += c * int.from_bytes(_flags(bits), "little")
            limits = map(table.__getitem__, which.to_bytes(len(slots), "little"))
        else:
            limits = templates.copy()
            for bits, assign in classes:
                for t, mine in order.by_template:
                    if x := bits & mine:
                        d = t.copy()
                        d.update(assign)
                        for q in _slots(x) if ident else map(pos.__getitem__, _slots(x)):
                            limits[q] = d
        out = list(map(PrefixMatch, workers, ranks, blocks, stale, map(dict.copy, limits)))
        if not first:
            return out
        rest = bytearray(b"\x01") * len(out)
        for q in first:
            rest[q] = 0
        best = list(map(out.__getitem__, first))
        best += compress(out, rest)
        return best

    def match(self, slot: int, chain: Sequence[BlockHash], media: Collection[str] | None = None,
              include_suspect: bool = False) -> PrefixMatch:
        self._masks()
        blocks, limits = self._per_slot(self.answer(chain, _BITS[slot], media, include_suspect))
        key = self._keys[slot]
        lim = limits.get(slot)
        if lim is None:
            lim = dict(self._templates.get(slot, {}))
        return PrefixMatch(key.worker, key.dp_rank, blocks.get(slot, 0), self._suspect[slot] > 0, lim)

    def prefix_hits(self, chain: Sequence[BlockHash], *, media: Collection[str] | None = None,
                    include_suspect: bool = False, include_unwatched: bool = False,
                    skip_workers: Collection[str] = (), min_blocks: int = 1) -> list[tuple[WorkerKey, int]]:
        """Worker ranks that can reuse at least `min_blocks` of the chain, with
        how many, deepest first (ties in slot order): the router's question,
        without one answer per worker of the fleet."""
        candidates = self._all if include_unwatched else self._watching
        for w in skip_workers:
            candidates &= ~self._worker_bits.get(w, 0)
        out = []
        for p, bits in self.answer(chain, candidates, media, include_suspect).blocks:
            if p < max(min_blocks, 1):
                break
            out += [(self._keys[s], p) for s in sorted(_slots(bits))]
        return out


def _segments(col: list[int] | None, n: int, sets: list[int] | None) -> tuple[list[int], list[int]]:
    """Runs of equal holder sets: (first position of each, its bitset). `col`
    holds sids when `sets` (sid → bitset) is given, else bitsets."""
    if not n:
        return [], []
    if col is None:
        return [0], [0]
    starts = [0]
    starts += compress(count(1), map(ne, col[1:], col))
    if sets is None:
        return starts, list(map(col.__getitem__, starts))
    return starts, list(map(sets.__getitem__, map(col.__getitem__, starts)))


def _equal_prefix(a: array[int], a0: int, b: array[int], b0: int, n: int) -> int:
    """How many of a[a0:a0+n] equal b[b0:b0+n] from the start (slices compared, halving)."""
    if n <= 0 or a[a0:a0 + n] == b[b0:b0 + n]:
        return max(n, 0)
    lo, hi = 0, n  # equal before lo; a difference before hi
    while hi - lo > 16:
        mid = (lo + hi) >> 1
        if a[a0 + lo:a0 + mid] == b[b0 + lo:b0 + mid]:
            lo = mid
        else:
            hi = mid
    while a[a0 + lo] == b[b0 + lo]:
        lo += 1
    return lo


def _dense_col(col: list[int], sets: list[int] | None) -> list[int]:
    return col if sets is None else list(map(sets.__getitem__, col))


def _dense_runs(src: array[int], runs: list[tuple[int, int, int]], n: int, sets: list[int]) -> list[int]:
    col = [0] * n
    for j, i, length in runs:
        col[j:j + length] = src[i:i + length]
    return list(map(sets.__getitem__, col))


def _pieces(seg_starts: list[int], seg_vals: list[int], n: int, n_full: int, k: int | None,
            dense: Callable[[], list[int]] | None) -> tuple[list[int], list[int]]:
    """The slots a width allows at each p in 0..n_full, as pieces: allowed(p)
    = vals[j] for starts[j] <= p < starts[j+1]. allowed(p) is the AND of the
    column over blocks max(0, p-k)..p-1 (k None: from block 0)."""
    starts = [0]
    vals = [_ALL]
    if k == 0:
        return starts, vals
    if seg_starts:
        if k is None:
            runs = list(accumulate(seg_vals, and_))
            try:
                z = runs.index(0)
            except ValueError:
                z = -1
            if z >= 0:
                starts += map(add, seg_starts[:z + 1], repeat(1))
                vals += runs[:z + 1]
                return starts, vals
            starts += map(add, seg_starts, repeat(1))
            vals += runs
        elif k == 1:
            starts += map(add, seg_starts, repeat(1))
            vals += seg_vals
        elif dense is not None and len(seg_starts) * min(k, len(seg_starts)) > 4 * n:
            _window_dense(dense(), n, k, starts, vals)
        else:
            _window_runs(seg_starts, seg_vals, n, k, starts, vals)
    if n < n_full:
        starts.append(n + 1)
        vals.append(0)
    return starts, vals


def _window_runs(seg_starts: list[int], seg_vals: list[int], n: int, k: int, starts: list[int],
                 vals: list[int]) -> None:
    """Window pieces from the runs: within run j (blocks a..b-1, holders V),
    position i sees V and, while i < end(t) + k - 1, the earlier runs t."""
    nseg = len(seg_starts)
    for j in range(nseg):
        a = seg_starts[j]
        v = seg_vals[j]
        if not v:
            starts.append(a + 1)
            vals.append(0)
            continue
        b = seg_starts[j + 1] if j + 1 < nseg else n
        back: list[tuple[int, int]] = []  # (last i that still sees run t, + 1; AND of runs t..j)
        acc = v
        t = j - 1
        while t >= 0:
            until = seg_starts[t + 1] + k - 1
            if until <= a:
                break
            acc &= seg_vals[t]
            back.append((until, acc))
            if not acc:
                break
            t -= 1
        if not back:
            starts.append(a + 1)
            vals.append(v)
            continue
        starts.append(a + 1)
        vals.append(back[-1][1])
        for idx in range(len(back) - 1, -1, -1):
            until = back[idx][0]
            if until >= b:
                break
            starts.append(until + 1)
            vals.append(back[idx - 1][1] if idx else v)


def _window_dense(col: list[int], n: int, k: int, starts: list[int], vals: list[int]) -> None:
    """Window pieces position by position (many short runs): van Herk's
    blocked prefix and suffix ANDs, then runs of the result."""
    pre: list[int] = []
    suf: list[int] = []
    for a in range(0, n, k):
        block = col[a:a + k]
        pre += accumulate(block, and_)
        suf += list(accumulate(reversed(block), and_))[::-1]
    seen = pre[:k - 1] + list(map(and_, suf[:max(0, n - k + 1)], pre[k - 1:]))
    seg_starts, seg_vals = _segments(seen, n, None)
    starts += map(add, seg_starts, repeat(1))
    vals += seg_vals


def _levels_points(seg_starts: list[int], seg_x: list[int], sets: list[int] | None, n: int, n_full: int,
                   mask: int) -> list[tuple[int, int]]:
    """`_levels` of the width 1 (allowed(p) = the holders of block p - 1),
    from the segments: each holder set counts at its last segment only, whose
    last p is the next segment's start (or n)."""
    if not seg_starts:
        return [(n_full, mask)] if not n_full else []
    out = []
    acc = 0
    last = len(seg_x) - 1
    back = seg_x[::-1]
    for x in dict.fromkeys(back):  # distinct holders, by last segment, deepest first
        if not x:
            continue
        v = x if sets is None else sets[x]
        new = v & ~acc & mask
        acc |= v
        if new:
            j = last - back.index(x)
            out.append((seg_starts[j + 1] if j < last else n, new))
    return out


def _levels(starts: list[int], vals: list[int], n_full: int, mask: int) -> list[tuple[int, int]]:
    """(deepest allowed p, slots) for the slots of `mask`, deepest first."""
    m = len(starts)
    ends = starts[1:] + [n_full + 1]
    if m == 1:
        return [(n_full, mask)]
    suf = list(accumulate(vals[:0:-1], or_))  # suf[r]: OR of pieces m-1-r .. m-1
    changes = [0]
    changes += compress(count(1), map(ne, suf[1:], suf))
    out = []
    prev = 0
    for r in changes:
        cur = suf[r]
        new = (cur ^ prev) & mask
        prev = cur
        if new:
            out.append((ends[m - 1 - r] - 1, new))
    # the rest stay at piece 0, which always ends at p = 0 (every width has a piece from 1)
    return out
