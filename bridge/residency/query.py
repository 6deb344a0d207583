"""The query engine: the hybrid rule (`bridge.residency.prefix`) for every
candidate worker rank at once, read off the tier columns.

A query turns the chain into runs of consecutive ids (`hash_ids`), each
group's column into runs of equal holder sets (slices of the column, equal
sets being equal sids, change points found by numpy over the slice), and
applies the rule per width: attention = the whole run from block 0, window =
its last k blocks, state = the block itself. Work per block is a few C-level
passes; work per worker only where a worker's answer is not 0. The result
(`Answer`) is bitsets; `answers` turns it into one `PrefixMatch` per worker.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from itertools import accumulate, compress, count, repeat
from operator import add, and_, ne, or_

import numpy as np

from bridge.contract import ATTENTION, STATE, WINDOW, BlockHash
from bridge.residency.hash_ids import HashIds, Runs, run_ids
from bridge.residency.prefix import GroupShape, window_blocks
from bridge.residency.slots import ALL
from bridge.residency.tier_columns import TierColumns

# Per group: (width, slots) for every width the rule gives that group in some
# worker: None = from block 0 (attention; window of unknown size), k = the
# last k blocks (window), 1 = the block itself (state).
Widths = list[tuple[int, list[tuple[int | None, int]]]]
# A run this short is compared entry by entry: numpy's fixed cost per call
# (a few µs) is more than the comparisons.
_SHORT = 48


class Answer:
    """One query's result, as bitsets: blocks and per-group limits by level."""

    __slots__ = ("blocks", "limits")

    def __init__(self) -> None:
        self.blocks: list[tuple[int, int]] = []  # (blocks, slots), deepest first, blocks > 0
        self.limits: list[tuple[int, list[tuple[int, int]]]] = []  # (group, [(limit, slots)])


def widths_of(shapes: Mapping[int, Mapping[int, GroupShape]]) -> tuple[Widths, dict[int, tuple[int, ...]]]:
    """The widths of every group (`Widths`), and per slot the groups the rule reads."""
    per_group: dict[int, dict[int | None, int]] = {}
    slot_groups: dict[int, tuple[int, ...]] = {}
    for slot, groups in shapes.items():
        b = 1 << slot
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
            per = per_group.setdefault(group, {})
            per[k] = per.get(k, 0) | b
            mine.append(group)
        slot_groups[slot] = tuple(sorted(mine))
    return [(g, list(ks.items())) for g, ks in sorted(per_group.items())], slot_groups


def run_segments(src: array[int], runs: Runs) -> tuple[list[int], list[int]]:
    """`_segments` of one column read along id runs: (starts, sids), a start
    exactly where the sid changes (blocks between runs hold nobody, sid 0).
    Each run is a slice of the column: one set when it equals that set
    repeated (a memcmp); otherwise its change points, entry by entry when
    the run is short, else in one numpy pass."""
    starts: list[int] = []
    sids: list[int] = []
    last = -1
    end = 0
    col = None
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
        offs = [0]
        if length <= _SHORT:
            offs += compress(count(1), map(ne, part[1:], part))
        else:
            if col is None:
                col = np.frombuffer(src, dtype=np.uint32)  # a view: no copy
            a = col[i:i + length]
            at = np.flatnonzero(a[1:] != a[:-1])
            at += 1
            offs += at.tolist()
        vs = list(map(part.__getitem__, offs))
        if vs[0] == last:
            del offs[0], vs[0]
        starts += map(add, offs, repeat(j)) if j else offs
        sids += vs
        last = sids[-1]
    return starts, sids


def _column(columns: TierColumns, sets: list[int], group: int, id_lists: list[list[int]],
            media: Collection[str] | None, include_suspect: bool) -> tuple[list[int] | None, bool]:
    """The group's holders along the chain, and whether as sids (one
    source: equal sets are equal sids) or as bitsets (an OR of several)."""
    grp = columns.groups.get(group)
    if grp is None:
        return None, False
    cols = [list(map(src.__getitem__, ids)) for src in grp.sources(media, include_suspect) for ids in id_lists]
    if not cols:
        return None, False
    if len(cols) == 1:
        return cols[0], True
    col = list(map(sets.__getitem__, cols[0]))
    for other in cols[1:]:
        col = list(map(or_, col, map(sets.__getitem__, other)))
    return col, False


def answer(ids: HashIds, columns: TierColumns, sets: list[int], widths: Widths, chain: Sequence[BlockHash],
           candidates: int, media: Collection[str] | None = None, include_suspect: bool = False) -> Answer:
    """The hybrid rule for every candidate slot at once (sid → bitset in `sets`)."""
    n_full = len(chain)
    ans = Answer()
    groups: list[tuple[int, int, list[tuple[int, list[int], list[int]]],
                      list[tuple[int, list[int], list[int], list[int] | None]], int]] = []
    levels: list[list[tuple[int, int]]] = []
    cons_all = 0
    id_lists: list[list[int]] | None = None
    runs: list[tuple[int, int, int]] | None = None
    looked = False
    n = 0
    S = sets
    for group, ks in widths:
        masks = [(k, m & candidates) for k, m in ks if m & candidates]
        if not masks:
            continue
        if not looked:
            looked = True
            got = ids.runs(chain if type(chain) is tuple else tuple(chain))
            if got is None:
                id_lists, n = ids.lookup(chain)
            else:
                runs, n = got
        grp = columns.groups.get(group)
        dense: Callable[[], list[int]] | None = None
        # the segments' holders: sids (seg_sets is S) or bitsets (seg_sets None)
        seg_sets: list[int] | None = None
        if runs is not None and n and grp is not None and len(srcs := grp.sources(media, include_suspect)) == 1:
            seg_starts, seg_x = run_segments(srcs[0], runs)
            seg_sets = S
            dense = partial(_dense_runs, srcs[0], runs, n, S)
        else:
            if runs is not None and id_lists is None:
                id_lists = [run_ids(runs, n)]
            col, sids = _column(columns, S, group, id_lists, media, include_suspect) if n else (None, False)  # type: ignore[arg-type]
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
    vals = [ALL]
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
