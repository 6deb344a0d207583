"""Types of the native module (`_cells.c`); `bridge.residency.cells` documents it."""

from typing import Any

from bridge.residency.cells import CellLike

# a class whose instances are tiers as `CellLike` describes them
Cell: type[CellLike]

def apply_run(slot_cells: dict[int, dict[str, Any]], g: Any, group: int, family: int, events: list[Any], start: int,
              memo: object, others: tuple[tuple[int, int, int], ...], kinds: tuple[type, ...], index: object,
              fields: tuple[Any, ...], /) -> int: ...
