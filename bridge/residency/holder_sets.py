"""Holder sets, interned: every set of worker ranks that holds some block is
stored once and named by a set id, a "sid".

0 is nobody, 2s+1 is slot s alone (no entry to keep), even sids are the
shared sets, counted by reference (one per column entry naming it) and
reused when no column names them. A column of sids (`tier_columns`) is thus
4 bytes per hash, and equal sets are equal sids.
"""

from __future__ import annotations

from array import array
from itertools import repeat


class ColumnCounts:
    """Counts of a held column: hashes with a holder, hashes with two or more."""

    __slots__ = ("distinct", "shared")

    def __init__(self) -> None:
        self.distinct = 0
        self.shared = 0


class HolderSets:
    """sid → bitset (`S`), bitset → even sid (`sid`), references of even sids (`sref`)."""

    __slots__ = ("S", "bits", "sid", "sref", "free_sids", "next_even")

    def __init__(self) -> None:
        self.S: list[int] = [0]
        # bits[s] is 1 << s, one object per slot taken: the per-block loops
        # index it rather than build a new int each time.
        self.bits: list[int] = []
        self.sid: dict[int, int] = {}
        self.sref: list[int] = [0]
        self.free_sids: list[int] = []
        self.next_even = 2

    def __len__(self) -> int:
        """Distinct shared sets in use."""
        return len(self.sid)

    def _grow(self, n: int) -> None:
        if len(self.S) < n:
            more = n - len(self.S)
            self.S.extend(repeat(0, more))
            self.sref.extend(repeat(0, more))

    def add_slot(self, slot: int) -> None:
        """The single set of a slot just taken."""
        self._grow(2 * slot + 2)
        bits = self.bits
        while len(bits) <= slot:
            bits.append(1 << len(bits))
        self.S[2 * slot + 1] = bits[slot]

    def sid_of(self, v: int) -> int:
        """The sid of a non-empty bitset (a new shared set starts unreferenced)."""
        if not v & (v - 1):
            return 2 * v.bit_length() - 1
        sid = self.sid.get(v)
        if sid is None:
            if self.free_sids:
                sid = self.free_sids.pop()
            else:
                sid = self.next_even
                self.next_even += 2
                self._grow(sid + 1)
            self.S[sid] = v
            self.sid[v] = sid
        return sid

    def release(self, sid: int) -> None:
        """One reference less to a shared set (forgotten at the last)."""
        r = self.sref[sid] - 1
        if r:
            self.sref[sid] = r
        else:
            self.sref[sid] = 0
            del self.sid[self.S[sid]]
            self.S[sid] = 0
            self.free_sids.append(sid)

    def hold(self, sid: int) -> None:
        """One reference more, if the sid is a shared set."""
        if sid and not sid & 1:
            self.sref[sid] += 1

    def drop(self, sid: int) -> None:
        """One reference less, if the sid is a shared set."""
        if sid and not sid & 1:
            self.release(sid)

    def with_slot(self, sid: int, slot: int) -> int:
        if not sid:
            return 2 * slot + 1
        return self.sid_of(self.S[sid] | self.bits[slot])

    def without(self, sid: int, slot: int) -> int:
        if sid == 2 * slot + 1:
            return 0
        return self.sid_of(self.S[sid] & ~self.bits[slot])

    def has(self, sid: int, slot: int) -> bool:
        return sid == 2 * slot + 1 or bool(sid and not sid & 1 and self.S[sid] & self.bits[slot])

    # -- writing a column that names sids -------------------------------------

    def put(self, owner: ColumnCounts, col: array[int], i: int, new: int) -> None:
        """A column that holds its sids (held, union held): col[i] = new."""
        old = col[i]
        if old == new:
            return
        new_shared = new and not new & 1
        old_shared = old and not old & 1
        if new_shared:
            self.sref[new] += 1
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
            self.release(old)

    def put2(self, owner: ColumnCounts, h: array[int], t: array[int], i: int, new_h: int, new_t: int) -> None:
        """held h and trusted t (t may be h) at i become new_h and new_t. A
        separate trusted column holds a reference only where it differs from h."""
        if t is h:
            self.put(owner, h, i, new_h)
            return
        old_h = h[i]
        old_t = t[i]
        if new_t != new_h and new_t and not new_t & 1:
            self.sref[new_t] += 1
        self.put(owner, h, i, new_h)
        t[i] = new_t
        if old_t != old_h and old_t and not old_t & 1:
            self.release(old_t)

    def join(self, owner: ColumnCounts, col: array[int], ids: list[int], slot: int,
             again: list[int] | None) -> list[int]:
        """The slot joins the holders at each id of a column that owns its
        sids; ids it is already at go to `again`. Consecutive blocks of a
        shared prefix make the same move, so it is computed once per run and
        the references are counted at the end. Returns the ids joined."""
        S = self.S
        b = self.bits[slot]
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
                last_new = self.sid_of(S[sid] | b)
            col[i] = last_new
            take(i)
            gained[last_new] = gained.get(last_new, 0) + 1
            if sid & 1:
                shared += 1
            else:
                lost[sid] = lost.get(sid, 0) + 1
        sref = self.sref
        for sid, c in gained.items():
            sref[sid] += c
        for sid, c in lost.items():
            r = sref[sid] - c
            if r:
                sref[sid] = r
            else:
                sref[sid] = 1
                self.release(sid)
        owner.distinct += distinct
        owner.shared += shared
        return fresh
