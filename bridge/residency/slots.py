"""Worker ranks as slots, and sets of slots as bitsets (Python ints).

The fleet structure names each worker rank by a small int, its slot, so a
set of ranks (the holders of a block, the candidates of a query) is one int
whose bit s stands for slot s: a union or an intersection over the whole
fleet is one C-level operation.
"""

from __future__ import annotations

from itertools import compress, count
from typing import NamedTuple

# BITS[s] is 1 << s, one object per slot: the hot loops index it rather than
# build a new int per block. It only ever grows (by `bit`), and equal slots
# give equal ints whoever filled it, so sharing it between fleets is safe.
BITS: list[int] = []
ALL = -1  # every bit
_BIN01 = bytes.maketrans(b"01", b"\x00\x01")


class WorkerKey(NamedTuple):
    worker: str
    dp_rank: int


def bit(slot: int) -> int:
    """1 << slot, making sure BITS covers the slot."""
    while len(BITS) <= slot:
        BITS.append(1 << len(BITS))
    return BITS[slot]


def slots_of(bits: int) -> list[int]:
    """The slots of a bitset, any order."""
    if bits.bit_count() <= 16:
        out = []
        while bits:
            s = bits.bit_length() - 1
            out.append(s)
            bits ^= BITS[s]
        return out
    return list(compress(count(), flags(bits)))


def flags(bits: int) -> bytes:
    """A bitset as one byte per slot (1 where set), up to its highest slot."""
    return bin(bits)[:1:-1].encode().translate(_BIN01)
