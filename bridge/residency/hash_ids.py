"""Hash ids: every block hash the fleet holds gets a small int, and a
request's chain is read back as runs of those ids.

Ids index the tier columns (`tier_columns`), so they are dense: freed when
nothing holds the hash any more and reused. id → hash lives in tuples of 256
(`chunks`), which the garbage collector stops tracking as they hold only ints
and bytes; `state` marks a freed id (its tuple still names the old hash until
the id is reused). New hashes take consecutive ids, so a stored chain is a
few runs of ids; an int hash of 64 bits is also kept in an `array('Q')` by id
(`n64`), for comparing runs with a request in C. Ints and bytes are kept
apart (a bytes query also looks up its int form, never the reverse), as
`bridge.residency.hashes` says.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, count, repeat
from operator import is_, ne
from typing import cast

from bridge.contract import BlockHash

SHIFT = 8
CHUNK = 1 << SHIFT
MASK = CHUNK - 1
_U64 = 1 << 64
# state of an id
FREE, INT64, OTHER = 0, 1, 2

Runs = list[tuple[int, int, int]]  # (position in the chain, first id, length)


def int_key(h: BlockHash) -> BlockHash:
    """The int form a bytes hash may be held under (`hashes.as_int` without the cut of ints)."""
    return int.from_bytes(h[-8:], "big") if type(h) is bytes else h


class HashIds:
    """hash ↔ id for the fleet. `on_grow(cap)` is told when ids reach past
    the capacity, so every array indexed by id grows with it."""

    def __init__(self, on_grow: Callable[[int], None], cap: int = 1024) -> None:
        self.by_hash: dict[BlockHash, int] = {}
        # id → hash, in tuples of CHUNK (id 0 is never a hash: unknown blocks look it up)
        self.chunks: list[tuple[BlockHash | None, ...]] = []
        self.next_id = 1
        self.free: list[int] = []
        self.cap = cap
        # Per id: FREE (a freed id's chunk keeps the old name), INT64 (an int
        # hash of 64 bits, its value in n64) or OTHER.
        self.state = bytearray(cap)
        self.n64 = array("Q", bytes(8 * cap))
        self.int_ids = 0
        self.bytes_ids = 0
        self._on_grow = on_grow

    def __len__(self) -> int:
        return len(self.by_hash)

    def hash_at(self, i: int) -> BlockHash:
        return self.chunks[i >> SHIFT][i & MASK]  # type: ignore[return-value]

    # -- naming --------------------------------------------------------------

    def intern(self, hashes: list[BlockHash]) -> list[int]:
        """The ids of these hashes, new ones for hashes not held."""
        get = self.by_hash.get
        ids = list(map(get, hashes))
        if None not in ids:
            return ids  # type: ignore[return-value]
        where = list(compress(count(), map(is_, ids, repeat(None))))
        missing = list(map(hashes.__getitem__, where))
        distinct = dict.fromkeys(missing)
        if len(distinct) != len(missing):
            # A hash twice in one store (a snapshot's tier lists a hash once
            # per copy): one new id for each, in the order they first came.
            named = dict(zip(distinct, self._new_ids(list(distinct))))
            for j in where:
                ids[j] = named[hashes[j]]
            return ids  # type: ignore[return-value]
        for j, i in zip(where, self._new_ids(missing)):
            ids[j] = i
        return ids  # type: ignore[return-value]

    def forget(self, i: int) -> None:
        """Nothing holds the hash of id i any more: free the id."""
        h = self.hash_at(i)
        del self.by_hash[h]  # its chunk keeps the stale name until the id is reused
        self.free.append(i)
        self.state[i] = FREE
        if type(h) is bytes:
            self.bytes_ids -= 1
        else:
            self.int_ids -= 1

    def _grow(self, need: int) -> None:
        cap = max(need, self.cap + (self.cap >> 2) + 1024)
        self.state += bytes(cap - self.cap)
        self.n64.frombytes(bytes(8 * (cap - self.cap)))
        self.cap = cap
        self._on_grow(cap)

    def _new_ids(self, hashes: list[BlockHash]) -> list[int]:
        """Ids for hashes not interned (distinct): freed ones first, then new."""
        free = self.free
        k = min(len(free), len(hashes))
        out = free[len(free) - k:]
        del free[len(free) - k:]
        if k:
            self._name(out, hashes)
            self._mark(out, hashes)
        if k < len(hashes):
            start = self.next_id
            self.next_id += len(hashes) - k
            out += range(start, self.next_id)
            if self.next_id > self.cap:
                self._grow(self.next_id)
            self._name_run(start, hashes[k:])
            fresh = hashes[k:]
            try:
                values = array("Q", cast(list[int], fresh))
            except (TypeError, OverflowError):
                self._mark(range(start, self.next_id), fresh)
            else:
                self.n64[start:self.next_id] = values
                self.state[start:self.next_id] = bytes([INT64]) * len(fresh)
        self.by_hash.update(zip(hashes, out))
        kinds = set(map(type, hashes))
        if kinds == {int}:
            self.int_ids += len(hashes)
        elif kinds == {bytes}:
            self.bytes_ids += len(hashes)
        else:
            nb = sum(1 for h in hashes if type(h) is bytes)
            self.bytes_ids += nb
            self.int_ids += len(hashes) - nb
        return out

    def _mark(self, ids: Iterable[int], hashes: list[BlockHash]) -> None:
        """state and n64 for ids just named."""
        state, n64 = self.state, self.n64
        for i, h in zip(ids, hashes):
            if isinstance(h, int) and 0 <= h < _U64:
                n64[i] = h
                state[i] = INT64
            else:
                state[i] = OTHER

    def _name(self, ids: list[int], hashes: list[BlockHash]) -> None:
        """id → hash for these ids: each chunk touched is rebuilt once."""
        chunks = self.chunks
        need = (max(ids) >> SHIFT) + 1
        if len(chunks) < need:
            chunks.extend(repeat((None,) * CHUNK, need - len(chunks)))
        by: dict[int, list[tuple[int, BlockHash]]] = {}
        for i, h in zip(ids, hashes):
            by.setdefault(i >> SHIFT, []).append((i & MASK, h))
        for j, changes in by.items():
            names = list(chunks[j])
            for k, h in changes:
                names[k] = h
            chunks[j] = tuple(names)

    def _name_run(self, start: int, hashes: list[BlockHash]) -> None:
        """id → hash for the new ids start, start+1, ...: chunk by chunk."""
        chunks = self.chunks
        need = ((start + len(hashes) - 1) >> SHIFT) + 1
        if len(chunks) < need:
            chunks.extend(repeat((None,) * CHUNK, need - len(chunks)))
        pos, i, n = 0, start, len(hashes)
        while pos < n:
            j, k = i >> SHIFT, i & MASK
            step = min(CHUNK - k, n - pos)
            if step == CHUNK:
                chunks[j] = tuple(hashes[pos:pos + step])
            else:
                names = list(chunks[j])
                names[k:k + step] = hashes[pos:pos + step]
                chunks[j] = tuple(names)
            pos += step
            i += step

    # -- reading a chain -----------------------------------------------------

    def lookup(self, chain: Sequence[BlockHash]) -> tuple[list[list[int]], int]:
        """The chain as id lists (one, or two when bytes may be held in int
        form too), cut after the last block anything holds; and that length."""
        get = self.by_hash.get
        lists = [list(map(get, chain, repeat(0)))]
        if self.int_ids and bytes in set(map(type, chain)):
            alt = list(map(get, map(int_key, chain), repeat(0)))
            lists = [lists[0], alt] if self.bytes_ids else [alt]
        n = 0
        for ids in lists:
            r = next(compress(count(), reversed(ids)), None)
            if r is not None:
                n = max(n, len(ids) - r)
        return [ids[:n] for ids in lists], n

    def runs(self, chain: tuple[BlockHash, ...]) -> tuple[Runs, int] | None:
        """The chain as runs (position, first id, length) of consecutive live
        ids, cut after the last block anything holds, and that length; None
        when a bytes block may be held in its int form (`lookup` then).

        Ids are handed out in the order hashes arrive, so a stored chain is a
        few runs: one dict lookup per run, its names checked a chunk at a
        time; after the first unknown block, one `isdisjoint` pass over the
        rest, and a lookup per block only if that finds something."""
        n_full = len(chain)
        q64: array[int] | None = None  # the chain as ints of 64 bits, if it is
        if self.int_ids and n_full:
            try:
                q64 = array("Q", cast(Sequence[int], chain))
            except (TypeError, OverflowError):
                if bytes in set(map(type, chain)):
                    return None
        get = self.by_hash.get
        runs: Runs = []
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
        m = min(len(chain) - j, self.next_id - i)
        state = self.state
        if q64 is not None:
            # ids of other hashes cannot equal these blocks: the run ends there
            stop = [x for x in (state.find(FREE, i, i + m), state.find(OTHER, i, i + m)) if x >= 0]
            if stop:
                m = max(1, min(stop) - i)
            return 1 + equal_prefix(q64, j + 1, self.n64, i + 1, m - 1)
        d = state.find(FREE, i, i + m)
        if d >= 0:
            m = d - i
        chunks = self.chunks
        length = 1
        while length < m:
            a = i + length
            off = a & MASK
            step = min(CHUNK - off, m - length)
            names = chunks[a >> SHIFT]
            part = names if step == CHUNK else names[off:off + step]
            mine = chain[j + length:j + length + step]
            if mine != part:
                return length + next(compress(count(), map(ne, mine, part)))
            length += step
        return length

    def _maybe_known(self, chain: tuple[BlockHash, ...], start: int) -> Iterable[int]:
        """The positions from `start` on whose blocks are known, in order
        (`isdisjoint` first: a tail of unknown blocks is one pass in C)."""
        rest = chain[start:]
        if self.by_hash.keys().isdisjoint(rest):
            return ()
        return compress(count(start), map(self.by_hash.__contains__, rest))


def run_ids(runs: Runs, n: int) -> list[int]:
    """The ids of the chain's first n blocks (0 where unknown), from its runs."""
    ids = [0] * n
    for j, i, length in runs:
        ids[j:j + length] = range(i, i + length)
    return ids


def equal_prefix(a: array[int], a0: int, b: array[int], b0: int, n: int) -> int:
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
