"""The hybrid prefix rule: how many leading blocks of a request one worker can reuse.

A hybrid model keeps several kv_cache_groups, and vLLM reuses a prefix of p
blocks only if every group can resume at p:

- attention: every block 0..p-1 is held (every hash is a prefix position);
- state (mamba): a checkpoint exactly at block p-1; earlier ones do not help;
- window: the last k blocks before p are held, k = ceil((window - 1) / block_size),
  vLLM's own count (`SlidingWindowManager`: blocks the window can still see);
  when p < k, blocks 0..p-1. Unknown window or block size: all of 0..p-1;
- other (encoder-only, cross-attention, unknown kinds): no say in prefix reuse.

The answer is the deepest p (0..len(chain)) that every group allows. A worker
with no attention, window or state group known reuses nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

import msgspec

from bridge.contract import ATTENTION, STATE, WINDOW, BlockHash
from bridge.residency.hashes import lookup_keys
from bridge.residency.slots import WorkerKey

# The families the hybrid prefix rule constrains; any other never limits a hit.
RULED_FAMILIES = frozenset((ATTENTION, WINDOW, STATE))

Table = Mapping[BlockHash, int]


class GroupShape(Protocol):
    """What the rule needs to know about one worker's group (a `views.GroupResidency`)."""

    @property
    def family(self) -> str: ...

    @property
    def window(self) -> int | None: ...

    @property
    def block_size(self) -> int: ...


class HeldGroup(GroupShape, Protocol):
    """A group whose tables `match_view` reads."""

    def tables(self, media: Iterable[str] | None, include_suspect: bool) -> list[Table]: ...


class HeldView(Protocol):
    """A worker's view as `match_view` reads it (a `views.WorkerView`)."""

    @property
    def key(self) -> WorkerKey: ...

    @property
    def stale(self) -> bool: ...

    @property
    def groups(self) -> Mapping[int, HeldGroup]: ...


class PrefixMatch(msgspec.Struct, frozen=True, gc=False):
    """One worker's answer for one request.

    Untracked by the cyclic garbage collector (`gc=False`): a query makes one
    per worker of the fleet, and tracked they would set off collections that
    walk the whole index; its fields (strings, ints, a dict of ints) cannot
    form a cycle with it."""

    worker: str
    dp_rank: int
    # Leading blocks of the chain every group can resume from.
    blocks: int
    # The view holds suspect entries (a gap or interruption since its last reset).
    stale: bool
    # Per group: the deepest p that group alone would allow.
    limits: dict[int, int]


def window_blocks(window: int | None, block_size: int) -> int | None:
    """Blocks a window group must hold before a hit; None when unknown."""
    if not window or window <= 0 or block_size <= 0:
        return None
    return -(-(window - 1) // block_size)


def _held(tables: list[Table], keys: list[tuple[BlockHash, ...]]) -> list[bool]:
    return [any(k in t for t in tables for k in ks) for ks in keys]


def group_limit(g: GroupShape, held: list[bool]) -> tuple[list[bool], int]:
    """(allowed[p] for p in 0..n, deepest allowed p) for one group, given
    which of the chain's blocks it holds (`held[i]` for block i)."""
    n = len(held)
    allowed = [True] * (n + 1)
    if g.family == STATE:
        for p in range(1, n + 1):
            allowed[p] = held[p - 1]
    else:
        need = window_blocks(g.window, g.block_size) if g.family == WINDOW else None
        run = 0
        for p in range(1, n + 1):
            run = run + 1 if held[p - 1] else 0
            # attention (need None): the run must reach back to block 0
            allowed[p] = run >= (p if need is None else min(need, p))
    deepest = max(p for p in range(n + 1) if allowed[p])
    return allowed, deepest


def needed_before(g: GroupShape, k: int) -> int:
    """How many of the blocks before k, the last ones, a group must hold
    for a hit of k blocks: a state group the checkpoint at k - 1, a window
    group its window's blocks, an attention group (or a window of unknown
    size) all k."""
    if k <= 0:
        return 0
    if g.family == STATE:
        return 1
    need = window_blocks(g.window, g.block_size) if g.family == WINDOW else None
    return k if need is None else min(need, k)


def allowed_at(g: GroupShape, held_at: Callable[[int], bool], k: int) -> bool:
    """`group_limit(g, held)[0][k]`, reading only the blocks it needs
    (`needed_before`), last first (`held_at(i)`: whether the group holds
    block i)."""
    return all(held_at(i) for i in range(k - 1, k - 1 - needed_before(g, k), -1))


def match_view(
    view: HeldView,
    chain: Sequence[BlockHash],
    media: Collection[str] | None = None,
    include_suspect: bool = False,
    keys: list[tuple[BlockHash, ...]] | None = None,
) -> PrefixMatch:
    keys = keys if keys is not None else [lookup_keys(h) for h in chain]
    n = len(chain)
    feasible = [True] * (n + 1)
    limits: dict[int, int] = {}
    constrained = False
    for group, g in sorted(view.groups.items()):
        if g.family not in RULED_FAMILIES:
            continue
        constrained = True
        held = _held(g.tables(media, include_suspect), keys)
        allowed, limits[group] = group_limit(g, held)
        feasible = [a and b for a, b in zip(feasible, allowed, strict=True)]
    blocks = max(p for p in range(n + 1) if feasible[p]) if constrained else 0
    return PrefixMatch(view.key.worker, view.key.dp_rank, blocks, view.stale, limits)


def match_views(
    views: Collection[HeldView],
    chain: Sequence[BlockHash],
    media: Collection[str] | None = None,
    include_suspect: bool = False,
) -> list[PrefixMatch]:
    """Every view's answer, best first (most blocks; ties keep index order)."""
    keys = [lookup_keys(h) for h in chain]
    out = [match_view(v, chain, media, include_suspect, keys) for v in views]
    out.sort(key=lambda m: -m.blocks)
    return out
