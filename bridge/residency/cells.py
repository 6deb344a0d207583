"""One rank's tier in the per-rank tables: hash → copies, in three layers.

`Cell` is the native one (`_cells.c`) when the package was built with it,
else `PyCell`, plain dicts; both keep hashes in the order they came, as a
dict does, so that a snapshot lists the same thing either way. The native
cell keeps each hash as its bytes (or an int's value), with 16 bytes an
entry and an index slot besides them, where a dict keeps a Python bytes
object and its entry: the snapshot keeper holds every hash of its worker's
caches, and that is most of its memory.

A layer is one of `TRUSTED`, `SUSPECT`, `PLACEHOLDER`. Readers that walk a
layer (`chunk`, `suspect_only`) go by position: the cell must not change
until they are done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from enum import IntEnum
from itertools import islice
from typing import Any, Protocol, TypeVar

from bridge.contract import BlockHash
from bridge.contract.kinds import ATTENTION, STATE, WINDOW

_K = TypeVar("_K")


class Layer(IntEnum):
    TRUSTED = 0
    SUSPECT = 1
    PLACEHOLDER = 2


TRUSTED, SUSPECT, PLACEHOLDER = Layer.TRUSTED, Layer.SUSPECT, Layer.PLACEHOLDER


class CellLike(Protocol):
    """What `RankTables` asks of a tier."""

    def store(self, hashes: Sequence[BlockHash], placeholder: bool, /) -> None: ...

    def remove(self, hashes: Sequence[BlockHash], /) -> int: ...

    def demote(self) -> None: ...

    def counts(self) -> tuple[int, int, int]: ...

    def copies(self, h: BlockHash, layer: int, /) -> int: ...

    def held(self, h: BlockHash, /) -> int: ...

    def holds_all(self, hashes: Sequence[BlockHash], /) -> bool: ...

    def chunk(self, layer: int, at: int, n: int, /) -> tuple[list[BlockHash], list[int], int]: ...

    def counts_of(self, layer: int, hashes: Sequence[BlockHash], /) -> list[int]: ...

    def suspect_only(self, at: int, n: int, /) -> tuple[list[BlockHash], list[int], int]: ...

    def entries(self) -> int: ...

    def has_suspect(self) -> bool: ...


def take_copy(table: dict[_K, int], key: _K) -> bool:
    """One copy less of `key` in a table of copies, which keeps no key at
    zero; False when it had none."""
    c = table.get(key)
    if not c:
        return False
    if c == 1:
        del table[key]
    else:
        table[key] = c - 1
    return True


class PyCell:
    """The tier as three dicts (the cell when `_cells` was not built)."""

    __slots__ = ("_layers", "_cursor")

    def __init__(self) -> None:
        self._layers: tuple[dict[BlockHash, int], dict[BlockHash, int], dict[BlockHash, int]] = ({}, {}, {})
        # (layer, position, iterator) of the last walk: the next chunk goes on from it
        self._cursor: tuple[int, int, Iterator[tuple[BlockHash, int]]] | None = None

    def store(self, hashes: Sequence[BlockHash], placeholder: bool, /) -> None:
        table = self._layers[PLACEHOLDER if placeholder else TRUSTED]
        get = table.get
        for h in hashes:
            table[h] = get(h, 0) + 1

    def remove(self, hashes: Sequence[BlockHash], /) -> int:
        removed = 0
        for h in hashes:
            for table in self._layers:
                if take_copy(table, h):
                    removed += 1
                    break
        return removed

    def demote(self) -> None:
        trusted, suspect, placeholders = self._layers
        if not trusted:
            return
        if not suspect:
            self._layers = ({}, trusted, placeholders)
            return
        get = suspect.get
        for h, n in trusted.items():
            suspect[h] = get(h, 0) + n
        self._layers = ({}, suspect, placeholders)

    def counts(self) -> tuple[int, int, int]:
        trusted, suspect, placeholders = self._layers
        return len(trusted), len(suspect), sum(placeholders.values())

    def copies(self, h: BlockHash, layer: int, /) -> int:
        return self._layers[layer].get(h, 0)

    def held(self, h: BlockHash, /) -> int:
        trusted, suspect, _ = self._layers
        n = trusted.get(h, 0)
        return n + suspect.get(h, 0) if suspect else n

    def holds_all(self, hashes: Sequence[BlockHash], /) -> bool:
        trusted, suspect, _ = self._layers
        if not suspect:
            return all(map(trusted.__contains__, hashes))
        return all(h in trusted or h in suspect for h in hashes)

    def _walk(self, layer: int, at: int) -> Iterator[tuple[BlockHash, int]]:
        cursor = self._cursor
        if cursor is not None and cursor[0] == layer and cursor[1] == at:
            return cursor[2]
        return islice(iter(self._layers[layer].items()), at, None)

    def chunk(self, layer: int, at: int, n: int, /) -> tuple[list[BlockHash], list[int], int]:
        pairs = self._walk(layer, at)
        got = list(islice(pairs, n))
        end = at + len(got)
        more = end < len(self._layers[layer])
        self._cursor = (layer, end, pairs) if more else None
        return [h for h, _ in got], [c for _, c in got], end if more else -1

    def counts_of(self, layer: int, hashes: Sequence[BlockHash], /) -> list[int]:
        get = self._layers[layer].get
        return [get(h, 0) for h in hashes]

    def suspect_only(self, at: int, n: int, /) -> tuple[list[BlockHash], list[int], int]:
        trusted = self._layers[TRUSTED]
        keys, copies, end = self.chunk(SUSPECT, at, n)
        pairs = [(h, c) for h, c in zip(keys, copies) if h not in trusted]
        return [h for h, _ in pairs], [c for _, c in pairs], end

    def entries(self) -> int:
        trusted, suspect, _ = self._layers
        return len(trusted.keys() | suspect.keys()) if suspect else len(trusted)

    def has_suspect(self) -> bool:
        return bool(self._layers[SUSPECT])


# A family as the native loop (`apply_run`) numbers it; 0: no say in prefixes.
FAMILY_CODES = {ATTENTION: 1, WINDOW: 2, STATE: 3}

ApplyRun = Callable[[dict[int, dict[str, Any]], Any, int, int, list[Any], int, object,
                     tuple[tuple[int, int, int], ...], tuple[type, ...], object, tuple[Any, ...]], int]


def _native() -> tuple[type[CellLike] | None, ApplyRun | None]:
    try:
        from bridge.residency._cells import Cell as NativeCell
        from bridge.residency._cells import apply_run as native_run
    except ImportError:
        return None, None
    return NativeCell, native_run


NATIVE_CELL, apply_run = _native()
# The cell new tables use: the native one when it was built.
Cell: type[CellLike] = NATIVE_CELL if NATIVE_CELL is not None else PyCell
