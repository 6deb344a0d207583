"""Building answers: a query's bitsets (`query.Answer`) as one `PrefixMatch`
per candidate worker rank, best first.

Work per worker is one `PrefixMatch` each (untracked by the collector) in
the index's order; their limits come from the classes of equal limits, so a
fleet whose answers are mostly 0 costs a few C-level passes, not a loop per
worker in Python.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from itertools import compress, count, repeat
from operator import truth
from typing import Any, NamedTuple

from bridge.residency.prefix import PrefixMatch
from bridge.residency.query import Answer
from bridge.residency.slots import WorkerKey, flags, slots_of


class Order(NamedTuple):
    """The candidates of a query in the index's order (cached until slots or shapes change)."""

    slots: list[int]
    workers: list[str]
    ranks: list[int]
    templates: list[dict[int, int]]  # per position: every group's limit 0 (shared, copied on the way out)
    pos: dict[int, int]  # slot → position
    ident: bool  # position == slot
    by_template: list[tuple[dict[int, int], int]]  # (template, its slots)
    stale: list[Any]  # [stale version it was computed at, per position: stale]


def templates_of(slot_groups: dict[int, tuple[int, ...]]) -> dict[int, dict[int, int]]:
    """Per slot: every group the rule reads at limit 0, one dict per set of
    groups (shared, never handed out)."""
    shared: dict[tuple[int, ...], dict[int, int]] = {}
    return {s: shared.setdefault(gs, dict.fromkeys(gs, 0)) for s, gs in slot_groups.items()}


def make_order(keys: dict[int, WorkerKey], slots: list[int], templates: dict[int, dict[int, int]]) -> Order:
    """The order of these slots (in `keys`' order), stale flags to be filled (`refresh_stale`)."""
    mine = [keys[s] for s in slots]
    empty: dict[int, int] = {}
    per = [templates.get(s, empty) for s in slots]
    by_template: dict[int, tuple[dict[int, int], int]] = {}
    for s, t in zip(slots, per):
        had = by_template.get(id(t), (t, 0))
        by_template[id(t)] = (t, had[1] | 1 << s)
    return Order(slots, [k.worker for k in mine], [k.dp_rank for k in mine], per, dict(zip(slots, count())),
                 slots == list(range(len(slots))), list(by_template.values()), [-1, []])


def refresh_stale(order: Order, version: int, suspect: list[int]) -> None:
    """The order's stale flags at this version of the per-slot suspect counts."""
    if order.stale[0] != version:
        order.stale[:] = [version, list(map(truth, map(suspect.__getitem__, order.slots)))]


def limit_classes(ans: Answer, candidates: int) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
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


def matches(order: Order, ans: Answer, candidates: int, skip: Collection[str] | None) -> list[PrefixMatch]:
    """Every position of the order (but the workers in `skip`), best first:
    most blocks, ties in the index's order."""
    slots, workers, ranks, templates, pos = order.slots, order.workers, order.ranks, order.templates, order.pos
    ident = order.ident
    stale: list[bool] = order.stale[1]
    if skip:
        keep = [j for j, w in enumerate(workers) if w not in skip]
        slots = [slots[j] for j in keep]
        workers = [workers[j] for j in keep]
        ranks = [ranks[j] for j in keep]
        templates = [templates[j] for j in keep]
        stale = [stale[j] for j in keep]
        pos = dict(zip(slots, count()))
        ident = False
    # Per position in the index's order: blocks, and the limits to copy
    # (the shared template unless a group's limit is not 0).
    depth = [0] * len(slots) if ans.blocks else []
    first: list[int] = []  # positions with blocks > 0: deepest first, ties in order
    for p, bits in ans.blocks:
        at = sorted(slots_of(bits) if ident else map(pos.__getitem__, slots_of(bits)))
        for q in at:
            depth[q] = p
        first += at
    blocks: Iterable[int] = depth if first else repeat(0)
    classes = limit_classes(ans, candidates)
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
            which += c * int.from_bytes(flags(bits), "little")
        limits = map(table.__getitem__, which.to_bytes(len(slots), "little"))
    else:
        limits = templates.copy()
        for bits, assign in classes:
            for t, mine in order.by_template:
                if x := bits & mine:
                    d = t.copy()
                    d.update(assign)
                    for q in slots_of(x) if ident else map(pos.__getitem__, slots_of(x)):
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


def one_match(ans: Answer, slot: int, key: WorkerKey, stale: bool, template: dict[int, int]) -> PrefixMatch:
    """One slot's answer (`ans` asked for that slot alone)."""
    blocks = 0
    b = 1 << slot
    for p, bits in ans.blocks:
        if bits & b:
            blocks = p
    lim = dict(template)
    for group, lv in ans.limits:
        for v, bits in lv:
            if v and bits & b:
                lim[group] = v
    return PrefixMatch(key.worker, key.dp_rank, blocks, stale, lim)


def hits(ans: Answer, keys: dict[int, WorkerKey], min_blocks: int) -> list[tuple[WorkerKey, int]]:
    """The slots with at least `min_blocks` (at least 1), deepest first, ties in slot order."""
    out = []
    for p, bits in ans.blocks:
        if p < max(min_blocks, 1):
            break
        out += [(keys[s], p) for s in sorted(slots_of(bits))]
    return out
